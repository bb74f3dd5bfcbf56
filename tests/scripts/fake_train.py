"""A stand-in for a training script under `hf-lossscale compare`, for the fault tests: it writes the
event log `LossScaleMixin` writes (run_start, a log per step, evals, run_end) in milliseconds, without
torch. Like the real recipes, the loss scale comes from `--config FILE` (`init_scale: N`), else
`HF_LOSSSCALE_INIT_SCALE`, else 2^16. `--spawn` runs the training in a child process, as `accelerate
launch` does; `--step_s` paces the steps so a test can signal it mid-run."""

import argparse
import json
import os
import subprocess
import sys
import time

parser = argparse.ArgumentParser()
parser.add_argument("--output_dir", required=True)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--max_steps", type=int, default=4)
parser.add_argument("--config", default=None)
parser.add_argument("--step_s", type=float, default=0.0)
parser.add_argument("--spawn", action="store_true")
parser.add_argument("--stop_at", type=int, default=None, help="Exit 0 after this step, without run_end.")
parser.add_argument("--child", action="store_true")
parser.add_argument("--fp16", action="store_true")
parser.add_argument("--loss_scale_init", type=float, default=None)
args, _unknown = parser.parse_known_args()

if args.spawn and not args.child:  # the launcher: starts the training process and waits for it
    sys.exit(subprocess.call([sys.executable, *sys.argv, "--child"]))

scale = 2.0**16
if os.environ.get("HF_LOSSSCALE_INIT_SCALE"):
    scale = float(os.environ["HF_LOSSSCALE_INIT_SCALE"])
if args.config:
    for line in open(args.config):
        key, _, value = line.partition(":")
        if key.strip() == "init_scale":
            scale = float(value)
if args.loss_scale_init is not None:
    scale = args.loss_scale_init
log = os.path.join(args.output_dir, "loss_scale_log.jsonl")


def write(event):
    os.makedirs(args.output_dir, exist_ok=True)  # as the Trainer does: an orphan recreates the folder
    with open(log, "a") as f:
        f.write(json.dumps(event) + "\n")


config = {"init_scale": scale} if args.fp16 else None
write(
    {
        "event": "run_start",
        "resumed": False,
        "loss_scale_config": config,
        "fp16": "emulated" if args.fp16 else None,
    }
)
for step in range(1, args.max_steps + 1):
    time.sleep(args.step_s)
    event = {"event": "log", "step": step, "loss": 2.0 / step + 0.01 * args.seed}
    if args.fp16:
        event.update(loss_scale=scale, skipped_steps=0)
    write(event)
    if step == args.max_steps // 2 or step == args.max_steps:
        write(
            {
                "event": "log",
                "step": step,
                "eval_loss": 1.0 / step + 0.01 * args.seed + (0.001 if args.fp16 else 0),
            }
        )
    if step == args.stop_at:
        sys.exit(0)
end = {"event": "run_end", "step": args.max_steps}
if args.fp16:
    end.update(total_steps=args.max_steps, skipped_steps=0, loss_scale=scale)
write(end)

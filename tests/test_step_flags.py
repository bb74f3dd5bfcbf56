"""One iteration's flags (`hf_lossscale.core.step_flags.StepFlags`) alone: the loss probe, the
found-inf flag in the shared buffer, and what an iteration's end resets."""

from __future__ import annotations

import copy
import pickle

import torch

from hf_lossscale.core.step_flags import StepFlags

CPU = torch.device("cpu")
META = torch.device("meta")  # another device than the scale's, without a GPU


def test_the_first_check_of_an_iteration_takes_the_buffer_and_only_the_first():
    """The first flag on the scale's device is the buffer's (zeroed), a second one in the same
    iteration a fresh tensor, and after `new_iteration()` the buffer's again. Bug caught: the flag
    not freed per iteration (every later check writes a fresh tensor, update() reads a stale
    buffer), or two optimizers sharing one flag (one's overflow skips the other)."""
    flags = StepFlags()
    buffer, found_view, _ = flags.views(CPU)
    found_view.fill_(1.0)  # last iteration's overflow
    first = flags.new_found(CPU, CPU)
    assert first.data_ptr() == found_view.data_ptr() and first.item() == 0.0
    second = flags.new_found(CPU, CPU)
    assert second.data_ptr() != buffer.data_ptr() and second.item() == 0.0
    flags.new_iteration()
    assert flags.new_found(CPU, CPU).data_ptr() == found_view.data_ptr()
    other = flags.new_found(META, CPU)  # a flag on another device is never the buffer's
    assert other.device == META


def test_the_probe_is_zero_for_finite_losses_nan_otherwise_and_ends_with_the_iteration():
    """Losses noted in one iteration add up into one probe (in the buffer for 1-element factors on
    the scale's device); one non-finite loss makes it NaN; `new_iteration()` hands it over and
    clears it. Bug caught: a probe carried into the next iteration (a finite step counted as a
    forward overflow), or accumulation that overwrites an earlier non-finite loss."""
    flags = StepFlags()
    assert flags.loss_finite() is None
    flags.note_loss(torch.tensor(8.0), CPU)  # a factor `scale + loss * 0`
    in_buffer = flags.views(CPU)[2]
    assert flags.probe is in_buffer and bool(flags.loss_finite())
    flags.note_loss(torch.tensor(float("inf")), CPU)
    flags.note_loss(torch.tensor(8.0), CPU)
    assert not bool(flags.loss_finite()) and flags.probe is in_buffer
    probe = flags.new_iteration()
    assert probe is in_buffer and torch.isnan(probe)
    assert flags.probe is None and flags.loss_finite() is None
    flags.note_loss(torch.full((3,), 8.0), CPU)  # several elements: summed, outside the buffer
    assert flags.probe is not in_buffer and flags.probe.item() == 0.0


def test_copies_leave_the_buffer_behind():
    """A pickled or deep-copied `StepFlags` makes its buffer again and frees the flag. Bug caught:
    the buffer's views coming back as copies of their own, so a check writes where update() no
    longer reads."""
    flags = StepFlags()
    flags.new_found(CPU, CPU)
    for clone in (pickle.loads(pickle.dumps(flags)), copy.deepcopy(flags)):
        buffer, found_view, _ = clone.views(CPU)
        assert clone.new_found(CPU, CPU).data_ptr() == found_view.data_ptr()
        assert buffer.tolist() == [0.0, 0.0, 1.0]

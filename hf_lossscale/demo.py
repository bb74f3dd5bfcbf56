"""Moved to `hf_lossscale.tools.demo`; this path stays for one release (`python -m hf_lossscale.demo`
keeps working)."""

if __name__ == "__main__":
    from hf_lossscale.tools.demo import main

    raise SystemExit(main())
else:
    import sys

    from hf_lossscale.tools import demo as _moved

    sys.modules[__name__] = _moved

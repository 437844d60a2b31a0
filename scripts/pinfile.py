"""The one Python reader of pin.env (scripts/lib.sh and the Makefile source the same file):
its KEY=VALUE lines as a dict. Used by scripts/rebase.py, scripts/build_kernels.py and the tests."""
import pathlib
import re

PIN = pathlib.Path(__file__).resolve().parents[1] / "pin.env"


def read_pin(path=PIN):
    return dict(re.findall(r"^([A-Z_][A-Z0-9_]*)=(.*)$", pathlib.Path(path).read_text(), re.M))

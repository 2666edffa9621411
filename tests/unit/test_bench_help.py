"""`moerl bench NAME --help` answers before torch loads, and `moerl --help` names every benchmark (issue 37 item
14: `moerl --help` listed 2 of 10 and promised fast --help, while each bench's --help took 4-8 s importing torch)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from moerl.bench import options
from moerl.cli import BENCHES

REPO = Path(__file__).resolve().parents[2]


def test_every_benchmarks_help_answers_without_torch_and_moerl_help_lists_them_all() -> None:
    code = f"""if True:
        import contextlib, io, sys
        from moerl.cli import main
        for name in {sorted(BENCHES)!r}:
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                try:
                    code = main(["bench", name, "--help"])
                except SystemExit as e:
                    code = e.code
            assert code in (0, None) and f"usage: moerl bench {{name}}" in out.getvalue(), (name, out.getvalue())
            heavy = sorted(m for m in ("torch", "ray") if m in sys.modules)
            assert not heavy, (name, heavy)
    """
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)
    out = subprocess.run([sys.executable, "-m", "moerl.cli", "--help"], cwd=REPO, capture_output=True, text=True,
                         timeout=60, check=True).stdout
    listed = out.split("benchmarks (moerl bench NAME):", 1)[1]
    assert all(name in listed for name in BENCHES), out


def test_the_options_choices_are_the_benchmarks_own_tables() -> None:
    from moerl.bench import dispatch, moe_decode, rollout

    assert set(options.DISPATCH_DTYPES) == set(dispatch.DTYPES)
    assert set(options.ROLLOUT_PRESETS) == set(rollout.PRESETS)
    assert set(options.MOE_DECODE_SHAPES) == set(moe_decode.SHAPES)
    assert set(options.OPTIONS) <= set(BENCHES)
    for name, (module, _) in options.OPTIONS.items():
        assert BENCHES[name] == module
        assert options.parser(name).description == sys.modules.get(module, __import__(module, fromlist=["x"])).__doc__

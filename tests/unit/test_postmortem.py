"""tests/postmortem.py: a pytest that died inside a test is named, with the Ray driver's last warnings."""
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _run(tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_dies.py").write_text(textwrap.dedent(body))
    (tmp_path / "conftest.py").write_text((REPO / "tests" / "conftest.py").read_text())  # the suite's hooks
    progress = tmp_path / "progress"
    env = {"MOERL_TEST_PROGRESS": str(progress), "PATH": "/usr/bin:/bin"}
    pytest = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                             "-c", "/dev/null", str(tmp_path / "test_dies.py")],
                            env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    ray_tmp = tmp_path / "ray" / "session_1" / "logs"
    ray_tmp.mkdir(parents=True)
    (ray_tmp / "python-core-driver-01_1.log").write_text(
        "[2026-12-04 15:00:05,000 I 1 2] core_worker.cc:1: fine\n"
        "[2026-12-04 15:00:06,025 E 1 2] gcs_rpc_client.h:1: Failed to connect to GCS within 60 seconds.\n")
    post = subprocess.run([sys.executable, str(REPO / "tests" / "postmortem.py"), str(progress), str(tmp_path / "ray")],
                          capture_output=True, text=True, timeout=60)
    return pytest, post


def test_a_test_that_exits_the_process_is_named(tmp_path):
    pytest, post = _run(tmp_path, """
        import os
        def test_fine():
            pass
        def test_dies():
            os._exit(1)
    """)
    assert pytest.returncode == 1
    assert "os._exit(1) in the pytest process, called from:" in pytest.stderr
    assert "test_dies.py::test_dies, " in post.stderr, post.stderr
    assert "test_fine" not in post.stderr
    assert "Failed to connect to GCS within 60 seconds." in post.stderr and "fine\n" not in post.stderr


def test_a_run_that_ends_normally_prints_nothing(tmp_path):
    pytest, post = _run(tmp_path, """
        def test_fails():
            assert False
    """)
    assert pytest.returncode == 1 and "1 failed" in pytest.stdout
    assert post.returncode == 0 and post.stderr == ""

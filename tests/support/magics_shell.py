"""Running cells in the in-process shell of tests/kernel/conftest.py, and what they print."""


def run(ip, capsys, code: str):
    """Run a cell; return (result, stdout, stderr)."""
    capsys.readouterr()
    res = ip.run_cell(code, store_history=False)
    out, err = capsys.readouterr()
    return res, out, err


def usage_error(ip, capsys, code: str) -> str:
    """Run a cell that must fail with exactly one UsageError line; return the message."""
    from IPython.core.error import UsageError

    res, out, err = run(ip, capsys, code)
    assert isinstance(res.error_in_exec, UsageError), (code, res.error_in_exec, out, err)
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("UsageError: "), err
    assert "Traceback" not in err and "Traceback" not in out
    return lines[0][len("UsageError: ") :]


def engine(ip):
    return ip.mlxcache.engine


GEN = "%%generate --max-tokens 8"

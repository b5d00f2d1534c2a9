"""What ``bin/test`` runs once PostgreSQL is up: trial, then one summary line.

``python -m tests.runner [TRIAL ARGS...]``. Options without test names run
the whole suite (``tests``); the selection is counted first (``trial
--dry-run``), and a selection of no tests fails at once (``trial -j`` would
hang on it); trial's output is shown as it comes and the last line says
``N passed, N failed``. The exit status is non-zero when anything failed, no
test ran, or trial did not finish.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

#: trial options whose value may come as the next argument.
VALUE_OPTIONS = frozenset(
    {
        "--debugger",
        "--jobs",
        "-j",
        "--logfile",
        "-l",
        "--order",
        "-o",
        "--reactor",
        "-r",
        "--recursionlimit",
        "--reporter",
        "--tbformat",
        "--temp-directory",
        "--testmodule",
        "--without-module",
        "--random",
        "-z",
    }
)


def with_default_tests(args: list[str]) -> list[str]:
    """``args``, plus ``tests`` (the whole suite) when they name no tests."""
    names = []
    takes_value = False
    for arg in args:
        if takes_value:
            takes_value = False
            continue
        if arg.startswith("-") and arg != "-":
            option = arg.split("=", 1)[0]
            if option == "--testmodule":
                names.append(arg)  # a test selection of its own
            takes_value = "=" not in arg and option in VALUE_OPTIONS
            continue
        names.append(arg)
    return args if names else [*args, "tests"]


def summarise(output: str) -> tuple[int, int, int]:
    """(passed, failed, skipped) from trial's output. Failed is at least 1 when
    trial printed no result line (it died or was killed) or ran no test."""
    results = [line for line in output.splitlines() if line.startswith(("PASSED", "FAILED"))]
    counts = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", results[-1] if results else "")}
    passed = counts.get("successes", 0)
    failed = counts.get("failures", 0) + counts.get("errors", 0) + counts.get("unexpectedSuccesses", 0)
    skipped = counts.get("skips", 0)
    if not results or passed + failed + skipped + counts.get("expectedFailures", 0) == 0:
        failed = max(failed, 1)
    return passed, failed, skipped


def summary_line(passed: int, failed: int, skipped: int) -> str:
    return f"{passed} passed, {failed} failed" + (f", {skipped} skipped" if skipped else "")


def count_tests(trial: list[str], args: list[str]) -> int:
    """How many tests ``args`` select (trial's dry run)."""
    dry = subprocess.run([*trial, "--dry-run", *args], capture_output=True, text=True)
    found = re.findall(r"^Ran (\d+) tests?", dry.stdout, re.M)
    if dry.returncode or not found:
        sys.stdout.write(dry.stdout + dry.stderr)
        return 0
    return int(found[-1])


def main(argv: list[str]) -> int:
    args = with_default_tests(argv)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trial = [sys.executable, "-m", "twisted.trial", f"--temp-directory={os.path.join(root, '_trial_temp')}"]
    selected = count_tests(trial, args)
    if selected == 0:
        print(f"test: no tests selected by {' '.join(args)}")
        print(summary_line(0, 1, 0))
        return 1
    jobs = min(int(os.environ.get("TRIAL_JOBS", "2")), selected)
    proc = subprocess.Popen([*trial, f"-j{jobs}", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            seen.append(line)
        status = proc.wait()
    except KeyboardInterrupt:  # interrupted: whatever ran, the run did not finish
        status = proc.wait()
    passed, failed, skipped = summarise("".join(seen))
    print(summary_line(passed, failed, skipped))
    if status < 0:  # killed by a signal: the shell's 128 + N
        status = 128 - status
    return status or (1 if failed else 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

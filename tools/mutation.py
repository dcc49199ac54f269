"""Mutation testing of the decoding core with mutmut 3 (`make mutation`; not part of `make test` or CI).

mutmut's configuration (which modules, which tests) is ``[tool.mutmut]`` in pyproject.toml. The
modules have about 2,700 mutants and a survivor costs every test that reaches its function (up
to ~3 minutes of one core), so all of them do not fit in an hour on 2 cores: this script draws a
seeded sample, stratified by module (each module its share of ``--size``, at least
``--per-module-floor``), runs mutmut on exactly those mutants (``mutmut run NAME ...``) and
prints killed / survived / timeout / no tests per module.

Mutants argued to be equivalent (the behaviour cannot change) are listed in
``tools/mutation_equivalents.txt`` with the mutated line and a one-line argument; they are
shown apart and left out of the kill rate's denominator, and only while the listed line still
matches the mutant's diff (else they count as survivors again).

    python tools/mutation.py run                 # sample, run, report (what `make mutation` does)
    python tools/mutation.py run --not-killed    # rerun only the sample's mutants not killed last time
    python tools/mutation.py report [--diffs]    # the table (and each survivor's diff) from the last run
    python tools/mutation.py list                # the sampled mutant names
    python tools/mutation.py run --modules hf_polybasic/runners/static.py hf_polybasic/schedule/shape_gate.py
                                                 # only these modules' share of the sample (a change's)
"""

from __future__ import annotations

import argparse
import json
import math
import random
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EQUIVALENTS = ROOT / "tools" / "mutation_equivalents.txt"
SEED = 24  # issue 24
SIZE = 300
PER_MODULE_FLOOR = 30
KILLED, SURVIVED, TIMEOUT, NO_TESTS, OTHER = "killed", "survived", "timeout", "no tests", "other"


def _mutmut_config():
    from mutmut.configuration import config

    return config()


def modules() -> list[Path]:
    """The files ``[tool.mutmut] only_mutate`` names, relative to the repository root."""
    return [Path(pattern) for pattern in _mutmut_config().only_mutate]


def all_mutants() -> dict[Path, list[str]]:
    """Every mutant mutmut makes of each module, by name (what ``mutmut run`` would generate)."""
    from mutmut.mutation.file_mutation import mutate_file_contents
    from mutmut.utils.format_utils import get_mutant_name

    return {
        path: sorted(get_mutant_name(path, name) for name in mutate_file_contents(str(path), path.read_text()).mutant_names)
        for path in modules()
    }


def sample(seed: int, size: int, floor: int) -> dict[Path, list[str]]:
    """A seeded sample, stratified by module: each module ceil(size * its share) mutants, at
    least ``floor`` (all of them if it has fewer)."""
    mutants = all_mutants()
    total = sum(len(names) for names in mutants.values())
    drawn = {}
    for path, names in mutants.items():
        count = min(len(names), max(floor, math.ceil(size * len(names) / total)))
        drawn[path] = sorted(random.Random(f"{seed}:{path}").sample(names, count))
    return drawn


def load_equivalents() -> dict[str, tuple[str, str]]:
    """name -> (mutated line, argument), from ``tools/mutation_equivalents.txt``: blocks of
    ``name`` / ``+ mutated line`` / ``# argument`` lines."""
    if not EQUIVALENTS.exists():
        return {}
    entries, name, line = {}, None, None
    for raw in EQUIVALENTS.read_text().splitlines():
        text = raw.strip()
        if not text or text.startswith("##"):
            continue
        if text.startswith("+"):
            line = text[1:].strip()
        elif text.startswith("#"):
            entries[name] = (line, text[1:].strip())
        else:
            name, line = text, None
    return entries


def mutated_line(name: str, path: Path) -> str:
    """The mutant's changed line(s), as the diff shows them ('+' lines, stripped, joined by ' / ')."""
    from mutmut.mutation.diff_apply import get_diff_for_mutant

    diff = get_diff_for_mutant(name, path=path)
    return " / ".join(line[1:].strip() for line in diff.splitlines() if line.startswith("+") and not line.startswith("+++"))


def statuses(drawn: dict[Path, list[str]]) -> dict[str, str]:
    from mutmut.stats import status_by_exit_code

    found = {}
    for path, names in drawn.items():
        meta = ROOT / "mutants" / f"{path}.meta"
        codes = json.loads(meta.read_text())["exit_code_by_key"] if meta.exists() else {}
        for name in names:
            status = status_by_exit_code[codes.get(name)]
            found[name] = status if status in (KILLED, SURVIVED, TIMEOUT, NO_TESTS) else OTHER
    return found


def report(drawn: dict[Path, list[str]], diffs: bool = False) -> float:
    """Print the per-module table and the survivors; return the kill rate (equivalents excluded)."""
    found = statuses(drawn)
    equivalents = load_equivalents()
    header = f"{'module':34} {'killed':>7} {'survived':>8} {'timeout':>7} {'no tests':>8} {'other':>5} {'equiv.':>6} {'total':>6} {'kill rate':>9}"
    print(header)
    print("-" * len(header))
    sums = defaultdict(int)
    survivors, stale = [], []
    for path, names in drawn.items():
        counts = defaultdict(int)
        for name in names:
            status = found[name]
            if status in (SURVIVED, NO_TESTS, OTHER) and name in equivalents:
                if mutated_line(name, path) == equivalents[name][0]:
                    status = "equivalent"
                else:
                    stale.append(name)
            if status in (SURVIVED, NO_TESTS, OTHER):
                survivors.append((path, name, status))
            counts[status] += 1
        counts["total"] = len(names)
        for key, value in counts.items():
            sums[key] += value
        _row(str(path), counts)
    print("-" * len(header))
    rate = _row("all sampled", sums)
    if stale:
        print(f"\nlisted as equivalent but the diff changed (counted as survivors): {stale}")
    if survivors:
        print(f"\n{len(survivors)} not killed:")
        for path, name, status in survivors:
            print(f"  {status:9} {name}: {mutated_line(name, path)}")
            if diffs:
                from mutmut.mutation.diff_apply import get_diff_for_mutant

                print("    " + get_diff_for_mutant(name, path=path).replace("\n", "\n    "))
    shown = {name: value for name, value in equivalents.items() if found.get(name) not in (None, KILLED, TIMEOUT)}
    if shown:
        print(f"\n{len(shown)} equivalent (left out of the kill rate):")
        for name, (_, argument) in sorted(shown.items()):
            print(f"  {name}: {argument}")
    return rate


def _row(label: str, counts: dict) -> float:
    tested = counts["total"] - counts["equivalent"]
    rate = (counts[KILLED] + counts[TIMEOUT]) / tested if tested else 0.0
    print(
        f"{label:34} {counts[KILLED]:7d} {counts[SURVIVED]:8d} {counts[TIMEOUT]:7d} {counts[NO_TESTS]:8d} "
        f"{counts[OTHER]:5d} {counts['equivalent']:6d} {counts['total']:6d} {rate:9.1%}"
    )
    return rate


def run(drawn: dict[Path, list[str]], max_children: int, not_killed: bool) -> None:
    names = [name for names in drawn.values() for name in names]
    if not_killed:
        found = statuses(drawn)
        names = [name for name in names if found[name] != KILLED]
    if not names:
        print("nothing to run")
        return
    mutmut = Path(sys.executable).parent / "mutmut"
    print(f"mutmut run --max-children {max_children} on {len(names)} mutants", flush=True)
    # mutmut redraws a progress line many times a second: its output goes to a log, the summary comes
    # from `report`
    log = ROOT / "mutants" / "mutmut-run.log"
    log.parent.mkdir(exist_ok=True)
    with log.open("w") as out:
        done = subprocess.run([str(mutmut), "run", "--max-children", str(max_children), *names], cwd=ROOT,
                              stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise SystemExit(f"mutmut run failed ({done.returncode}); the end of {log}:\n{tail}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["run", "report", "list"])
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--size", type=int, default=SIZE, help="sample size before the per-module floor")
    parser.add_argument("--per-module-floor", type=int, default=PER_MODULE_FLOOR)
    parser.add_argument("--max-children", type=int, default=2)
    parser.add_argument("--not-killed", action="store_true", help="run: only the mutants not killed last time")
    parser.add_argument("--diffs", action="store_true", help="report: each survivor's diff")
    parser.add_argument("--modules", nargs="+", default=None,
                        help="only these modules' share of the sample (paths as in [tool.mutmut] only_mutate)")
    args = parser.parse_args(argv)
    drawn = sample(args.seed, args.size, args.per_module_floor)
    if args.modules is not None:
        unknown = sorted(set(args.modules) - {str(path) for path in drawn})
        if unknown:
            raise SystemExit(f"--modules: {unknown} are not in [tool.mutmut] only_mutate ({sorted(map(str, drawn))})")
        drawn = {path: names for path, names in drawn.items() if str(path) in args.modules}
    if args.command == "list":
        print("\n".join(name for names in drawn.values() for name in names))
        return 0
    if args.command == "run":
        run(drawn, args.max_children, args.not_killed)
    report(drawn, diffs=args.diffs)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""README is what a newcomer reads first: the two commands for a fresh machine, what reffsdp
is, a sharding and a parity example, links and the reading order. The parity suite's and
the benchmark's references live in docs/, linked from it, and what they show matches what
the commands print today."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from reffsdp.testing import __main__ as cli
from reffsdp.testing.parity_suite import SuiteOptions, list_scenarios

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
PARITY_DOC = ROOT / "docs" / "parity-suite.md"


def test_the_two_commands_for_a_fresh_machine_come_first():
    first_block = re.search(r"```bash\n(.*?)```", README, flags=re.DOTALL)
    assert first_block.start() < README.index("\n## ")
    commands = [line for line in first_block.group(1).splitlines() if not line.startswith("#")]
    assert commands[0].startswith("python3 -m venv .venv && .venv/bin/pip install")
    assert '"torch==2.13.0"' in commands[0] and commands[0].endswith("python -m reffsdp.testing")
    assert commands[-1] == "bash ci/cpu.sh"


def test_the_references_live_in_docs_and_readme_links_them():
    for path in ("docs/parity-suite.md", "docs/benchmarks.md", "docs/api.md", "docs/testing.md"):
        assert f"]({path})" in README, path
        assert (ROOT / path).is_file(), path
    assert "| option | what it does |" not in README  # the options table is in docs/
    assert "IQR ms" not in README and "### Scaling" not in README  # so are the bench tables
    benchmarks = (ROOT / "docs" / "benchmarks.md").read_text()
    assert "IQR ms" in benchmarks and "## Scaling" in benchmarks


def test_every_option_of_the_parity_suite_is_documented():
    documented = PARITY_DOC.read_text()
    for action in cli.build_parser()._actions:
        for flag in action.option_strings:
            if flag.startswith("--") and flag != "--help":
                assert f"`{flag}" in documented, flag


def test_the_sample_output_matches_todays_suite():
    """The default run (threaded ranks) runs every scenario of the matrix, skipping none."""
    total = len(list_scenarios(SuiteOptions()))
    for text in (README, PARITY_DOC.read_text()):
        (summary,) = set(re.findall(r"`(\d+) passed, 0 failed, (\d+) skipped in [\d.]+ s`", text))
        assert summary == (str(total), "0")
    assert f"`[12/{total}] PASS fully_shard/hsdp/bf16/mlp 1.2 s`" in PARITY_DOC.read_text()


def test_development_names_the_extra_tox_installs():
    tox = (ROOT / "tox.ini").read_text()
    (extra,) = set(re.findall(r"^extras = (\w+)$", tox, flags=re.MULTILINE))
    development = README[README.index("## Development") :]
    assert f"`{extra}` extra" in development


def test_the_reading_order_starts_at_the_naive_page():
    section = README[README.index("## Reading the code") :].split("\n## ")[0]
    files = re.findall(r"`([\w/]+\.py)`", section)
    assert files[0] == "reffsdp/naive.py" and (ROOT / files[0]).is_file()
    assert files.index("core/sharding.py") < files.index("per_param/fully_shard.py")


def test_every_field_of_a_run_in_the_json_report_is_documented():
    from reffsdp.testing.report import RunInfo

    section = PARITY_DOC.read_text().split("## `--json FILE`")[1].split("\n## ")[0]
    for field in dataclasses.fields(RunInfo):
        assert f"`{field.name}`" in section, field.name


def test_on_a_cluster_shows_both_launchers_the_swap_and_a_batch_script():
    import shlex
    import subprocess

    from reffsdp.bench.cli import parser as bench_parser

    section = README.split("## On a cluster")[1].split("\n## ")[0]
    assert "--rdzv-backend c10d --rdzv-endpoint" in section
    assert "python -m reffsdp.swap train.py" in section and "-m reffsdp.swap -m " in section
    blocks = "".join(re.findall(r"```bash\n(.*?)```", section, flags=re.DOTALL))
    commands = [
        line for line in blocks.replace("\\\n", " ").splitlines()
        if "-m reffsdp.testing" in line or "-m reffsdp.bench" in line
    ]  # fmt: skip
    launchers = {command.split()[0] for command in commands}
    assert launchers == {"torchrun", "srun"}, commands
    for command in commands:  # what follows the module name parses
        words = shlex.split(command)
        module = words[words.index("-m") + 1]
        args = words[words.index(module) + 1 :]
        if module == "reffsdp.testing":
            cli.build_parser().parse_args(args)
        else:
            bench_parser().parse_args(args)
    batch = ROOT / "ci" / "slurm.sbatch"
    assert "(ci/slurm.sbatch)" in section and "srun python -m reffsdp.testing" in batch.read_text()
    assert subprocess.run(["bash", "-n", str(batch)]).returncode == 0


def test_the_torch_versions_section_names_the_tested_range_and_the_cpu_index():
    """README's versions table lists every release from the oldest supported to the newest
    tested (the ones CI pins among them), and how to take torch's CPU build."""
    section = README[README.index("## Torch versions") :].split("\n## ")[0]
    pinned = [
        re.search(r"torch==([\d.]+)", (ROOT / "ci" / "torch" / name).read_text()).group(1)
        for name in ("oldest.txt", "newest.txt")
    ]
    rows = re.findall(r"^\| (2\.\d+\.\d+) \|", section, flags=re.MULTILINE)
    assert rows[0] == pinned[0] and rows[-1] == pinned[1] and "2.13.0" in rows
    minors = [int(version.split(".")[1]) for version in rows]
    assert minors == list(range(minors[0], minors[-1] + 1))  # none left out
    assert "download.pytorch.org/whl/cpu" in section
    assert "reffsdp/core/compat.py" in section and "torch>=2.11,<2.16" in section

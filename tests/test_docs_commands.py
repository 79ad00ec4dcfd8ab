"""Every command in README.md and docs/*.md runs as written.

How to mark a block of commands (for whoever adds one to the docs): put one of these HTML comments on
the line right before the block's opening fence. GitHub does not show them.

    <!-- doc-test: run -->                  run the block in bash as written
    <!-- doc-test: run PROGRAM ARGS -->     run it, with ARGS appended to each command of PROGRAM: a smaller run,
                                            since a later option wins. PROGRAM is the command up to its first
                                            option or argument: fedper-export, fedper-export verify,
                                            fedper-emulate run, fedper demo (`fedper emulate run` counts as
                                            fedper-emulate run). Several: `PROGRAM ARGS | PROGRAM ARGS`
    <!-- doc-test: help -->                 run each command with --help appended, in this process: checks the
                                            program, its subcommand and every option name (for services that wait
                                            for devices, and for runs of minutes and more); fedper commands only,
                                            and NAME="..." lines, whose $NAME the commands after them may use
    <!-- doc-test: skip REASON -->          not run, for the REASON written there (placeholders such as `...`,
                                            a remote host, a GPU, torchrun, a download)

A block of commands is a fenced block tagged sh, bash, shell or console, or any fenced block with a line
that starts with a command (fedper..., make, python, torchrun, pip, docker, ...); an unmarked one fails
test_every_command_block_is_marked, so a new command cannot escape. One mode per block: split a block
to mix modes.

How run blocks run: the blocks of one document run in order in one temporary directory, which is also
$HOME, so an export made by one block serves the next and `~/cifar10`, `~/cifar100`, `~/data/cifar`
(CIFAR-shaped image folders of synthetic images), `dev-a/` and `dev-b/` (image folders of digits) and
`.venv` (this checkout's) are there (make_fixtures); the venv is first on PATH; port 1883 becomes a free
port; a bare `wait` fails when a background job failed; OMP_NUM_THREADS is 1 unless the block sets it
(processes that share 2 cores run faster so). Each block must exit 0 within BLOCK_TIMEOUT_S. Keep the
run blocks few and small: this file's test runs them all in a few minutes.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from fedper.data.sources import CIFAR10_CLASSES
from fedper.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK_TIMEOUT_S = 420

MARK = re.compile(r"^<!--\s*doc-test:\s*(\S+)\s*(.*?)\s*-->\s*$")
FENCE = re.compile(r"^```\s*(\S*)")
SHELL = {"sh", "bash", "shell", "console"}
ASSIGNMENTS = r"(?:[A-Za-z_][A-Za-z0-9_]*=\S*\s+)*"
COMMAND = re.compile(rf"^{ASSIGNMENTS}(fedper(?:-[a-z]+)?|make|python3?|torchrun|pip|docker|sudo|systemctl|"
                     rf"mosquitto\S*|curl|\.)(?:\s|$)")
FEDPER = re.compile(rf"^\s*{ASSIGNMENTS}(fedper(?:-[a-z]+)?)(?:\s+([a-z][a-z0-9-]*)(?=\s|$))?")
ROLES = ("export", "agent", "coordinator", "emulate")
HEREDOC = re.compile(r"<<-?\s*['\"]?(\w+)['\"]?")
VARIABLE = re.compile(r'^([A-Za-z_][A-Za-z0-9_]*)="([^"$`]*)"$')  # NAME="value", nothing to expand in it


@dataclass
class Block:
    doc: Path
    line: int  # of the opening fence, 1-based
    info: str
    lines: list[str]
    mode: str | None = None
    args: str = ""
    errors: list[str] = field(default_factory=list)

    @property
    def where(self) -> str:
        doc = self.doc.relative_to(ROOT) if self.doc.is_relative_to(ROOT) else self.doc
        return f"{doc}:{self.line}"


def command_blocks(doc: Path) -> list[Block]:
    """The fenced blocks of `doc` that hold commands, with their marks."""
    lines = doc.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), len(lines))
        body = lines[i + 1 : end]
        if fence.group(1) in SHELL or any(COMMAND.match(line) for line in _outside_heredocs(body)):
            block = Block(doc, i + 1, fence.group(1), body)
            mark = MARK.match(lines[i - 1]) if i else None
            if mark:
                block.mode, block.args = mark.group(1), mark.group(2)
            blocks.append(block)
        i = end + 1
    return blocks


def _outside_heredocs(lines: list[str]) -> list[str]:
    """The block's lines without heredoc bodies (a Python script fed to `python -` is not a command)."""
    kept, until = [], None
    for line in lines:
        if until is not None:
            until = None if line.strip() == until else until
            continue
        kept.append(line)
        heredoc = HEREDOC.search(line)
        until = heredoc.group(1) if heredoc else None
    return kept


def logical_commands(lines: list[str]) -> list[str]:
    """Commands as the shell reads them: continuation lines joined, comments, blanks and heredocs left out."""
    commands, current = [], ""
    for line in _outside_heredocs(lines):
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        current += line[:-1] + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            commands.append(current)
            current = ""
    return commands


def _program(command: str) -> str | None:
    """The fedper program and subcommand a command runs (fedper-export, fedper-export verify, fedper-emulate run
    for `fedper-emulate run ...` and `fedper emulate run ...`, fedper plot); None for other commands."""
    words = FEDPER.match(command)
    if not words:
        return None
    program, sub = words.groups()
    if program == "fedper" and sub in ROLES:
        program, sub = f"fedper-{sub}", re.match(r"\s*([a-z][a-z0-9-]*)(?=\s|$)", command[words.end():])
        sub = sub.group(1) if sub else None
    return f"{program} {sub}" if sub else program


def _clauses(args: str) -> dict[str, str]:
    """A run mark's `PROGRAM ARGS | PROGRAM ARGS` as {program: args}, PROGRAM the words before the first option."""
    clauses = {}
    for clause in filter(None, (c.strip() for c in args.split("|"))):
        program, _, extra = clause.partition(" -")
        clauses[program.strip()] = f"-{extra}" if extra else ""
    return clauses


def check(block: Block) -> list[str]:
    """What is wrong with a block's mark: none, an unknown mode, a skip without a reason, a run clause
    naming a program the block does not run, a help block with another command than fedper's."""
    if block.mode is None:
        return [f"{block.where}: a block of commands without a mark; put <!-- doc-test: run|help|skip REASON --> "
                f"on the line before its fence (tests/test_docs_commands.py says how)"]
    if block.mode not in ("run", "help", "skip"):
        return [f"{block.where}: unknown doc-test mode {block.mode!r}; run, help or skip"]
    if block.mode == "skip" and not block.args:
        return [f"{block.where}: doc-test: skip needs a reason"]
    programs = {_program(c) for c in logical_commands(block.lines)}
    if block.mode == "run":
        return [f"{block.where}: doc-test: run names {program}, which the block does not run"
                for program in _clauses(block.args) if program not in programs]
    if block.mode == "help":
        errors = [f"{block.where}: doc-test: help runs fedper commands only, not {c!r}"
                  for c in logical_commands(block.lines) if _program(c) is None and not VARIABLE.match(c.strip())]
        return errors + ([f"{block.where}: doc-test: help takes no arguments"] if block.args else [])
    return []


def test_every_command_block_is_marked():
    blocks = [b for doc in DOCS for b in command_blocks(doc)]
    assert len(blocks) > 20  # the parser finds the docs' blocks
    errors = [e for b in blocks for e in check(b)]
    assert not errors, "\n".join(errors)


def test_the_mark_rules_catch_what_they_say(tmp_path):
    """An unmarked block (also untagged, found by its command), a skip without a reason and a run clause for a
    program the block lacks are refused; a heredoc's Python is not taken for commands."""
    doc = tmp_path / "x.md"
    doc.write_text("\n".join([
        "```", "fedper-export --out a/", "```", "",
        "<!-- doc-test: skip -->", "```sh", "fedper demo", "```", "",
        "<!-- doc-test: run fedper-export --width 0.25 -->", "```bash", "fedper-emulate run \\", "  --rounds 1", "```",
        "", "```", "python - <<'EOF'", "import fedper", "EOF", "```",
        "", "```text", "  fedper-agent is indented: a diagram, not a command", "```",
    ]) + "\n")
    blocks = command_blocks(doc)
    assert [b.line for b in blocks] == [1, 6, 11, 16]
    errors = [e for b in blocks for e in check(b)]
    assert len(errors) == 4
    assert "without a mark" in errors[0] and "needs a reason" in errors[1]
    assert "fedper-export, which the block does not run" in errors[2] and "without a mark" in errors[3]
    assert [c.split() for c in logical_commands(blocks[2].lines)] == [["fedper-emulate", "run", "--rounds", "1"]]
    assert [_program(c) for c in ("fedper-export --out a/", "fedper-export verify a/", "fedper emulate run --x 1",
                                  "OMP_NUM_THREADS=1 fedper-emulate figure fig2", "fedper plot runs/x", "make demo")] \
        == ["fedper-export", "fedper-export verify", "fedper-emulate run", "fedper-emulate figure", "fedper plot", None]
    assert _clauses("fedper-export --width 0.25 | fedper-emulate run --rounds 1") == \
        {"fedper-export": "--width 0.25", "fedper-emulate run": "--rounds 1"}


# ---------------------------------------------------------------- running the blocks


def _png(path: Path, pixels: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path)


def make_fixtures(home: Path) -> None:
    """The data the docs' commands name: CIFAR-shaped image folders (random 32x32 images under the real
    class names, train/ and test/) and two devices' folders of real digits."""
    from sklearn.datasets import load_digits

    rng = np.random.default_rng(0)
    for root, classes, (n_train, n_test) in (
        (home / "cifar10", CIFAR10_CLASSES, (20, 10)),
        (home / "cifar100", [f"class{c:03d}" for c in range(100)], (4, 2)),
    ):
        for split, n in (("train", n_train), ("test", n_test)):
            for c, name in enumerate(classes):
                for i in range(n):
                    base = rng.integers(0, 256, 3, dtype=np.uint8)  # a colour per class, noise around it
                    pixels = np.clip(base + rng.normal(0, 40, (32, 32, 3)) + c, 0, 255).astype(np.uint8)
                    _png(root / split / name / f"{i}.png", pixels)
    (home / "data").mkdir()
    (home / "data" / "cifar").symlink_to(home / "cifar10")
    (home / ".venv").symlink_to(Path(sys.executable).parent.parent)
    digits = load_digits()
    for device, classes in (("dev-a", range(5)), ("dev-b", range(5, 10))):
        for c in classes:
            for i, index in enumerate(np.flatnonzero(digits.target == c)[:12]):
                small = (digits.images[index] * (255 / 16)).astype(np.uint8)
                big = np.asarray(Image.fromarray(small).resize((32, 32), Image.Resampling.BILINEAR))
                _png(home / device / str(c) / f"{i}.png", np.repeat(big[..., None], 3, axis=-1))


def runnable_script(block: Block, port: int) -> str:
    """The block as bash runs it: each command of a run clause's program with the clause's ARGS appended,
    port 1883 replaced, a bare `wait` failing when a background job failed."""
    clauses = _clauses(block.args)
    out, until, current = [], None, ""
    for line in block.lines:
        if until is not None:
            out.append(line)
            until = None if line.strip() == until else until
            continue
        heredoc = HEREDOC.search(line)
        until = heredoc.group(1) if heredoc else None
        current += line[:-1] + " " if line.endswith("\\") else line
        if line.endswith("\\"):
            continue
        command, current = current, ""
        extra = clauses.get(_program(command) or "")
        if extra:
            code, comment = re.match(r"^(.*?)(\s+#.*)?$", command).groups()  # type: ignore[union-attr]
            background = code.rstrip().endswith("&")
            code = code.rstrip().removesuffix("&").rstrip()
            command = f"{code} {extra}{' &' if background else ''}{comment or ''}"
        if command.strip() == "wait":
            command = 'for job in $(jobs -p); do wait "$job" || exit 1; done'
        out.append(re.sub(r"\b1883\b", str(port), command))
    return "\n".join(out) + "\n"


def _run_block(block: Block, home: Path) -> None:
    script = home / f"block-{block.line}.sh"
    script.write_text(runnable_script(block, free_port()))
    env = os.environ | {"HOME": str(home), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
                        "MPLBACKEND": "Agg", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(["bash", "-e", "-o", "pipefail", str(script)], cwd=home, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"{block.where}: still running after {BLOCK_TIMEOUT_S} s:\n{script.read_text()}\n{output[-3000:]}")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # a background job the block left behind
    assert proc.returncode == 0, f"{block.where} failed ({proc.returncode}):\n{script.read_text()}\n{output[-4000:]}"


def _apps() -> dict:
    from fedper.cli import app
    from fedper.coordinator.cli import app as coordinator
    from fedper.edge.cli import app as agent
    from fedper.emulate.cli import app as emulate
    from fedper.export.cli import app as export

    return {"fedper": app, "fedper-export": export, "fedper-agent": agent, "fedper-coordinator": coordinator,
            "fedper-emulate": emulate}


def _help_block(block: Block) -> None:
    apps, variables = _apps(), {}
    for command in logical_commands(block.lines):
        if variable := VARIABLE.match(command.strip()):
            variables[variable.group(1)] = variable.group(2)
            continue
        code = re.sub(r"\s+#.*$", "", command).rstrip().removesuffix("&")
        code = re.sub(r"\$(\w+)", lambda m: variables.get(m.group(1), m.group(0)), code)
        words = shlex.split(re.sub(rf"^\s*{ASSIGNMENTS}", "", code))
        result = CliRunner().invoke(apps[words[0]], [*words[1:], "--help"])
        assert result.exit_code == 0 and "Usage:" in result.output, \
            f"{block.where}: `{command.strip()} --help` failed:\n{result.output}"


RUNNABLE = [doc for doc in DOCS if any(b.mode in ("run", "help") for b in command_blocks(doc))]


@pytest.mark.long
@pytest.mark.parametrize("doc", RUNNABLE, ids=[str(d.relative_to(ROOT)) for d in RUNNABLE])
def test_doc_commands_run_as_written(doc: Path, tmp_path: Path) -> None:
    blocks = command_blocks(doc)
    assert not [e for b in blocks for e in check(b)]
    if any(b.mode == "run" for b in blocks):
        make_fixtures(tmp_path)
    for block in blocks:
        if block.mode == "run":
            _run_block(block, tmp_path)
        elif block.mode == "help":
            _help_block(block)

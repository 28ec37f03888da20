"""Every ```python block of README.md and docs/*.md runs as it is written.

What a reader does with a block, the test does; nothing is provided that the page does not
provide (no fixture checkpoint, no predefined names):

- **A block is a whole script.** The blocks of one markdown file run in file order in one fresh
  temporary working folder, each in a fresh process (or set of ranks). Files carry over,
  names do not: a block that writes a tiny checkpoint (``ckpt/``) serves the blocks after it,
  and ``import mymodel`` finds a ``mymodel.py`` written there.
- ``# file: NAME.py`` as a block's first line: the block is written to NAME.py in the folder,
  not run.
- ``<!-- continues the block above -->`` on the line before a fence: the block is appended to
  the one before it and they run as one script (the page's prose says so to the reader).
- ``<!-- not run: REASON -->`` on the line before a fence: not run (a fragment, an output
  example); the reason is required. Shell commands belong in non-python blocks.
- ``<!-- run in bash, needs: NAME ... -->`` on the line before a ```bash fence: the block runs
  as a bash script (``set -euo pipefail``) in the page's folder, in file order with the python
  blocks, with this Python's ``bin/`` first on PATH (``python``, ``torchrun``, ``shardwise``);
  it skips where a NAME is neither a command on that PATH nor an importable module (``tox -e
  remote`` has the object-store ones). A server it starts in the background is stopped after it
  (the block runs in a session of its own, and whatever is left of that session is killed).
- **Launch.** Every ``torchrun --nproc-per-node N`` named in the block or in the paragraph right
  before its fence runs it on N gloo ranks (``shardwise.testing.spawn``, which sets torchrun's
  environment); every ``python NAME.py`` named there runs it as one process without a launcher's
  environment; in the order written, in the same folder (so a command named twice checks that
  the script can be run again). A block that names neither runs as one process.
- A block that imports transformers, diffusers or PEFT skips, naming the library, where that is not
  installed (the gloo tox env); ``tox -e hf`` runs tests/docs with both.
- A failing block fails its test; the traceback shows the markdown file's own line numbers.

Single items can be selected (``-k README``): the blocks before one in its file run first.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from harness import RankFailure, run_ranks

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*(\S*)")
_NOT_RUN = re.compile(r"^\s*<!--\s*not run:\s*(.*?)\s*-->\s*$")
_BASH = re.compile(r"^\s*<!--\s*run in bash(?:,\s*needs:\s*(.*?))?\s*-->\s*$")
_CONTINUES = re.compile(r"^\s*<!--\s*continues the block above\s*-->\s*$")
_MARKER = re.compile(r"^\s*<!--.*-->\s*$")
_FILE = re.compile(r"^#\s*file:\s*([\w.-]+\.py)\b")
_LAUNCH = re.compile(r"torchrun --nproc-per-node (\d+)|\bpython3? ([\w./-]+\.py)\b")
_LIBRARIES = re.compile(r"^\s*(?:from|import)\s+(transformers|diffusers|peft)\b", re.M)
_LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
TIMEOUT = 300.0  # one launch; a rank imports transformers in a few seconds on a quiet machine


@dataclass
class Block:
    line: int              # 1-based line of the first code line
    code: str
    prose: str             # the paragraph right before the fence
    not_run: str | None = None
    continues: bool = False
    bash_needs: list[str] | None = None  # a bash block to run: the commands or modules it needs


@dataclass
class Script:
    """One or more blocks run together: a unit of the test."""

    page: Path
    blocks: list[Block]
    file_name: str | None = None   # written to this file instead of run
    launches: list[int | None] = field(default_factory=list)  # ranks, or None: one process, no launcher

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.blocks[0].line}"

    @property
    def bash(self) -> bool:
        return self.blocks[0].bash_needs is not None

    @property
    def libraries(self) -> list[str]:
        return sorted({m for b in self.blocks for m in _LIBRARIES.findall(b.code)})

    def source(self) -> str:
        """The blocks placed at their own line numbers, so tracebacks point into the page."""
        lines: list[str] = []
        for block in self.blocks:
            lines += [""] * (block.line - 1 - len(lines))
            lines += block.code.splitlines()
        return "\n".join(lines) + "\n"


def parse_blocks(text: str) -> list[Block]:
    """The ```python blocks of a markdown text, with their markers and preceding paragraph."""
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.groups()
        end = i + 1
        while end < len(lines) and not lines[end].strip().startswith(fence):
            end += 1
        bash = None
        j = i - 1
        while lang in ("bash", "sh") and j >= 0 and _MARKER.match(lines[j]):
            if (b := _BASH.match(lines[j])) is not None:
                bash = (b.group(1) or "").split()
            j -= 1
        if bash is not None:
            code = "\n".join(ln[len(indent):] if ln.startswith(indent) else ln for ln in lines[i + 1:end])
            blocks.append(Block(i + 2, code, "", bash_needs=bash))
        if lang in ("python", "py"):
            code = "\n".join(ln[len(indent):] if ln.startswith(indent) else ln for ln in lines[i + 1:end])
            j, not_run, continues = i - 1, None, False
            while j >= 0 and _MARKER.match(lines[j]):
                if (nr := _NOT_RUN.match(lines[j])) is not None:
                    not_run = nr.group(1)
                    if not not_run:
                        raise ValueError(f"line {j + 1}: '<!-- not run: -->' needs a reason")
                continues |= bool(_CONTINUES.match(lines[j]))
                j -= 1
            while j >= 0 and not lines[j].strip():
                j -= 1
            para = []
            while j >= 0 and lines[j].strip() and not _FENCE.match(lines[j]):
                para.append(lines[j])
                j -= 1
            blocks.append(Block(i + 2, code, "\n".join(reversed(para)), not_run, continues))
        i = end + 1
    return blocks


def _launches(text: str) -> list[int | None]:
    return [int(n) if n else None for n, _ in _LAUNCH.findall(text)] or [None]


def scripts_of(page: Path) -> list[Script]:
    scripts: list[Script] = []
    for block in parse_blocks(page.read_text()):
        if block.not_run is not None:
            continue
        if block.continues:
            if not scripts or scripts[-1].file_name:
                raise ValueError(f"{page.name}:{block.line}: 'continues' follows no runnable block")
            scripts[-1].blocks.append(block)
            continue
        if block.bash_needs is not None:
            scripts.append(Script(page, [block], launches=[]))
            continue
        m = _FILE.match(block.code)
        scripts.append(Script(page, [block], file_name=m.group(1) if m else None,
                              launches=[] if m else _launches(block.prose + "\n" + block.code)))
    return scripts


SCRIPTS = [s for page in PAGES for s in scripts_of(page)]


def _exec_script(filename: str, source: str, folder: str, launcher: bool) -> None:
    """Run on each rank: the script's code as ``__main__``, in ``folder``, as ``python script.py`` would."""
    if not launcher:
        for name in _LAUNCH_ENV:
            os.environ.pop(name, None)
    os.chdir(folder)
    sys.path.insert(0, folder)
    exec(compile(source, filename, "exec"), {"__name__": "__main__", "__builtins__": __builtins__})


class _Page:
    """The working folder of one page and what its scripts did, so that they run in order once."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.outcome: dict[int, str] = {}   # script index -> "ok" | "skipped: ..." | "failed"
        self.failures: dict[int, str] = {}  # script index -> its report


_PAGES: dict[Path, _Page] = {}


def _run_bash(script: Script, folder: Path) -> None:
    """The bash block in ``folder``, in a session of its own that is killed after it."""
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    needs = script.blocks[0].bash_needs or []
    missing = [n for n in needs if shutil.which(n, path=path) is None and importlib.util.find_spec(n) is None]
    if missing:
        pytest.skip(f"{script.id} needs {', '.join(missing)}, not installed here (tox -e remote runs it)")
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_ENV}
    proc = subprocess.Popen(["bash", "-euo", "pipefail", "-c", script.blocks[0].code], cwd=folder,
                            env={**env, "PATH": path}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        out = f"(no end within {TIMEOUT:.0f} s)"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # what the block left running (a server)
        except ProcessLookupError:
            pass
        proc.wait()
    if proc.returncode != 0:
        pytest.fail(f"{script.id} (bash) exited with {proc.returncode}:\n{out[-6000:]}", pytrace=False)


def _run(script: Script, folder: Path) -> None:
    if script.bash:
        _run_bash(script, folder)
        return
    missing = [lib for lib in script.libraries if importlib.util.find_spec(lib) is None]
    if missing:
        pytest.skip(f"{script.id} imports {', '.join(missing)}, not installed here (tox -e hf runs it)")
    if script.file_name:
        (folder / script.file_name).write_text(script.source())
        return
    for ranks in script.launches:
        failure = None
        try:
            run_ranks(_exec_script, ranks or 1, str(script.page), script.source(), str(folder),
                      ranks is not None, timeout=TIMEOUT)
        except RankFailure as e:
            failure = str(e)
        if failure is not None:  # outside the except: the report is the ranks' tracebacks, once
            what = f"{ranks} ranks (torchrun)" if ranks else "one process"
            pytest.fail(f"{script.id} failed on {what}:\n{failure}", pytrace=False)


def _attempt(index: int, page: _Page) -> str:
    """Run one script of ``page``: "ok", "skipped: REASON" or "failed" (the report kept)."""
    try:
        _run(SCRIPTS[index], page.folder)
    except pytest.skip.Exception as e:
        return f"skipped: {e.msg}"
    except pytest.fail.Exception as e:
        page.failures[index] = e.msg
        return "failed"
    return "ok"


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(SCRIPTS)), ids=[s.id for s in SCRIPTS])
def test_block_runs(index, tmp_path_factory):
    script = SCRIPTS[index]
    page = _PAGES.get(script.page)
    if page is None:
        page = _PAGES[script.page] = _Page(tmp_path_factory.mktemp(script.page.stem))
    earlier = [i for i, s in enumerate(SCRIPTS[:index]) if s.page == script.page]
    for i in earlier:
        if i not in page.outcome:
            page.outcome[i] = _attempt(i, page)
    not_ok = [f"{SCRIPTS[i].id} {page.outcome[i]}" for i in earlier if page.outcome[i] != "ok"]
    page.outcome[index] = outcome = _attempt(index, page)
    if outcome == "ok":
        return
    if outcome.startswith("skipped: "):
        pytest.skip(outcome.removeprefix("skipped: "))
    earlier_note = f"\n(earlier blocks of this page: {'; '.join(not_ok)})" if not_ok else ""
    pytest.fail(f"{page.failures[index]}{earlier_note}", pytrace=False)


def test_markers_are_well_formed():
    """Every page parses; a marker is followed by a python block; every page has its blocks run."""
    for page in PAGES:
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            if _BASH.match(line):
                nxt = next((ln for ln in lines[i + 1:] if not _MARKER.match(ln)), "")
                m = _FENCE.match(nxt)
                assert m and m.group(3) in ("bash", "sh"), (
                    f"{page.name}:{i + 1}: 'run in bash' stands before no bash fence")
            elif _NOT_RUN.match(line) or _CONTINUES.match(line):
                nxt = next((ln for ln in lines[i + 1:] if not _MARKER.match(ln)), "")
                m = _FENCE.match(nxt)
                assert m and m.group(3) in ("python", "py"), (
                    f"{page.name}:{i + 1}: a code-block marker must stand right before a ```python fence")
    assert any(s.page.name == "README.md" and not s.file_name for s in SCRIPTS), "README's example is run"


def test_parse_conventions():
    text = "\n".join([
        "Run `torchrun --nproc-per-node 2 a.py`, then `python a.py`:",
        "",
        "```python",
        "x = 1",
        "```",
        "<!-- continues the block above -->",
        "```python",
        "y = x",
        "```",
        "<!-- not run: an output example -->",
        "```python",
        "boom",
        "```",
        "```bash",
        "python b.py",
        "```",
    ])
    blocks = parse_blocks(text)
    assert [(b.line, b.code, b.continues, b.not_run) for b in blocks] == [
        (4, "x = 1", False, None), (8, "y = x", True, None), (12, "boom", False, "an output example")]
    assert _launches(blocks[0].prose) == [2, None]
    assert _launches("") == [None]
    script = Script(Path("p.md"), blocks[:2])
    assert script.source().splitlines()[3] == "x = 1" and script.source().splitlines()[7] == "y = x"
    with pytest.raises(ValueError, match="needs a reason"):
        parse_blocks("<!-- not run: -->\n```python\nx\n```")

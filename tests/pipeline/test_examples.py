"""Every shell example of README.md, of each page of docs/ and of every `--help` epilog, run.

Each example runs in a fresh copy of a temporary tree holding everything the examples name:
complete small runs under `runs/demo`, `runs/pile` and `runs/pythia` (one real run, made here by
`arslice run` on the standard library), the files the examples read (`val.jsonl.zst`,
`pile/train/*.jsonl.zst`, `data.parquet`, `train.bin`, Pythia-style `pythia/document.bin` with
its `.idx` and its 21 shards, `tokenizer.json`, small `transformers` checkpoints `pythia-70m/`
and `my-model/` with the run's tokenizer, the demo's `demo-models/`), and the `# NAME.toml`
blocks of the README and the docs as files.
Before a command that writes `--out DIR` runs, DIR is removed, so the example computes it anew.

  * `arslice ...` runs in this process, and must exit 0;
  * an example marked in its text as needing the hub, a GPU, a Ray cluster, the Pile or a
    published checkpoint (a trailing `# needs ...`) can only be parsed here: its flags are
    parsed into the command's config (what --dry-run does before its checks);
  * `arslice run` on the demo config runs with --dry-run (the whole demo is minutes of training;
    tests/pipeline/test_demo_e2e.py runs it end to end), `arslice train` stops after TRAIN_STEPS (keeping
    checkpoints at two of them, TRAIN_KEEP, when the example keeps some) and
    `arslice mqar` trains tiny cells (MQAR_TINY);
  * `make TARGET` is `make -n TARGET` (what it would run), and a pipeline target is checked as
    `arslice run --config CONFIG --dry-run`, which is what it runs first;
  * a ```python block runs as a script, a `$ command` transcript must print what it shows, and
    any other shell line runs under bash.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests import REPO
from tests.conftest import small_pipeline_config
from tests.tiny_models import save_neox

NEEDS = re.compile(
    r"#.*\bneeds (the hub|a GPU|a Ray cluster|the Pile|a published checkpoint)", re.IGNORECASE
)
ASSIGNMENT = re.compile(r"^([A-Z_][A-Z0-9_]*)=(.*)$")
# what a transcript of the docs makes (`python tests/make_tiny_run.py runs/tiny`); in the tree for
# the examples that use it
TRANSCRIPTS_MAKE = ("runs/tiny",)
# `arslice train` examples train for hundreds of steps (minutes on a CPU); here they stop after
# TRAIN_STEPS (a later `--steps` wins): the same code path, flags and outputs, minutes sooner
TRAIN_STEPS = "3"
# ... and an example that keeps checkpoints along the way keeps two of those three steps
TRAIN_KEEP = ["--keep-checkpoints", "1", "2"]
# `arslice mqar` examples train dozens of models for minutes each; here every cell is tiny (later
# flags win), so the same code path writes the same files in seconds
MQAR_TINY = ["--steps", "3", "--d-models", "16", "--seq-lens", "16", "--n-test", "8"]
MQAR_TINY += ["--batch-tokens", "64", "--eval-every", "3", "--workers", "1"]


@dataclasses.dataclass
class Example:
    where: str  # README.md:LINE, docs/PAGE.md:LINE or `arslice CMD --help`
    text: str  # the command (continuation lines joined), or a whole block
    kind: str  # "shell", "python" or "transcript"
    context: tuple[str, ...] = ()  # variable assignments before it in its block
    expected: str = ""  # what a transcript prints

    @property
    def needs(self) -> str | None:
        m = NEEDS.search(self.text)
        return m.group(1) if m else None


# ---- finding the examples ---------------------------------------------------------------------


def _commands(lines: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """Shell lines with their continuations joined; blank and comment-only lines dropped."""
    out, pending, start = [], "", 0
    for number, line in lines:
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        out.append((start, pending + stripped))
        pending = ""
    return out


def _shell_examples(where: str, lines: list[tuple[int, str]]) -> list[Example]:
    examples, context = [], []
    for number, command in _commands(lines):
        if ASSIGNMENT.match(command):
            context.append(command)
            continue
        examples.append(Example(f"{where}:{number}", command, "shell", tuple(context)))
    return examples


# the README and every page of docs/ (the pages it links to, and the tables runs wrote there)
DOC_PAGES = ["README.md", *sorted(f"docs/{p.name}" for p in (REPO / "docs").glob("*.md"))]


def page_examples(page: str) -> tuple[list[Example], dict[str, str]]:
    """One page's shell, python and transcript examples, and its `# NAME` files."""
    lines = (REPO / page).read_text().splitlines()
    examples, files, i = [], {}, 0
    while i < len(lines):
        m = re.match(r"^```(\w*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        lang, start = m.group(1), i + 1
        i += 1
        while not lines[i].startswith("```"):
            i += 1
        body = lines[start:i]
        i += 1
        first = next((b for b in body if b.strip()), "")
        where = f"{page}:{start + 1}"
        if lang == "python":
            examples.append(Example(where, "\n".join(body), "python"))
        elif lang == "toml" and first.startswith("# "):
            files[first[2:].strip()] = "\n".join(body) + "\n"
        elif first.startswith("$ "):
            examples.append(Example(where, "\n".join(body), "transcript"))
        elif lang in ("bash", "sh", "") and re.match(r"\s*(arslice|make|\.venv/|python|#)", first):
            examples += _shell_examples(page, list(enumerate(body, start + 1)))
    return examples, files


def doc_examples() -> tuple[list[Example], dict[str, str]]:
    """The examples and `# NAME` files of every page of DOC_PAGES; a name two pages give must
    name the same text (the tree holds one file of it)."""
    examples, files = [], {}
    for page in DOC_PAGES:
        found, named = page_examples(page)
        examples += found
        for name, text in named.items():
            assert files.setdefault(name, text) == text, f"{page}: another {name} than before"
    return examples, files


def help_examples() -> list[Example]:
    """Every example line of `arslice --help` and of each `arslice CMD --help`."""
    from pipeline.cli import EPILOG
    from pipeline.runner.registry import commands

    epilogs = {"arslice --help": EPILOG.split("examples:\n", 1)[1].split("\n\n")[0]}
    for name, command in commands().items():
        epilogs[f"arslice {name} --help"] = command.examples
    examples = []
    for where, text in epilogs.items():
        assert text.strip(), f"{where} has no examples"
        examples += _shell_examples(where, list(enumerate(text.splitlines(), 1)))
    return examples


DOCS, DOC_FILES = doc_examples()
HELP = help_examples()


def _params(examples: list[Example]):
    return [pytest.param(e, id=e.where) for e in examples]


# ---- the tree the examples run in ---------------------------------------------------------------


def fixture_run_config(root: Path) -> str:
    """The small pipeline of the other tests, with two attention models named as the examples
    name them (`transformer_pp`, the demo's reference, and `pythia-160m`), saved in bf16 as a
    folder of prebuilt models holds them (`arslice export-models`), and the demo's report
    settings."""
    text = small_pipeline_config(root, report="bootstrap = 200", train='saved_dtype = "bf16"')
    names = {
        '[train.models.attention]\narch = "attention"\n': (
            '[train.models.transformer_pp]\narch = "transformer_pp"\n'
        ),
        '[train.models.base_conv]\narch = "base_conv"\n': (
            '[train.models.pythia-160m]\narch = "attention"\nseed = 1\n'
        ),
        'reference = "attention"\n': 'reference = "transformer_pp"\n',
    }
    for old, new in names.items():
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    return text


def _pile_records(texts: list[str], subset: str) -> bytes:
    import json

    import zstandard

    lines = [json.dumps({"text": t, "meta": {"pile_set_name": subset}}) for t in texts]
    return zstandard.ZstdCompressor().compress(("\n".join(lines) + "\n").encode())


def _tiny_neox(path: Path, tokenizer_json: Path, vocab: int) -> None:
    import transformers
    from tokenizers import Tokenizer

    save_neox(path, vocab, num_attention_heads=4, max_position_embeddings=512)
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_file(str(tokenizer_json)), eos_token="<|endoftext|>"
    )
    tok.save_pretrained(path)


@pytest.fixture(scope="session")
def example_tree(tmp_path_factory, stdlib_texts) -> Path:
    """The tree every example runs in (copied for each)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ar_slicing.data.store import TokenStore
    from pipeline.cli import main
    from tests.ar_slicing.test_megatron import write_megatron

    root = tmp_path_factory.mktemp("examples")
    build = root / "build"
    build.mkdir()
    (build / "run.toml").write_text(fixture_run_config(build))
    assert main(["run", "--config", str(build / "run.toml")]) == 0
    tree = root / "tree"
    for name in ("demo", "pile", "pythia"):
        shutil.copytree(build / "run", tree / "runs" / name)
    for name in ("pile", "pythia"):  # reports not made yet (the demo's is, with its settings)
        shutil.rmtree(tree / "runs" / name / "report")
    for part in ("train-00", "train-01"):
        shutil.copytree(
            build / "run" / "tokens" / "train", tree / "runs" / "pile" / "tokens" / part
        )
    tokenizer = build / "run" / "tokenizer.json"
    for name in ("tokenizer.json", "t.json"):
        shutil.copy(tokenizer, tree / name)

    texts = stdlib_texts
    (tree / "pile" / "train").mkdir(parents=True)
    for name, part, subset in (
        ("val.jsonl.zst", texts[:3], "Github"),
        ("00.jsonl.zst", texts[3:6], "Github"),
        ("01.jsonl.zst", texts[6:9], "ArXiv"),
        ("train.jsonl.zst", texts[9:15], "Pile-CC"),
        ("pile/val.jsonl.zst", texts[:3], "Github"),
        ("pile/train/00.jsonl.zst", texts[3:6], "Github"),
        ("pile/train/01.jsonl.zst", texts[6:9], "ArXiv"),
    ):
        (tree / name).write_bytes(_pile_records(part, subset))
    pq.write_table(pa.table({"content": texts[:5]}), tree / "data.parquet")

    stream = np.asarray(TokenStore.open(build / "run" / "tokens" / "train").tokens)
    raw = np.concatenate([stream[:5000], [50256]]).astype("<u2")
    raw.tofile(tree / "train.bin")
    # Pythia's layout: rows of 2049 tokens, one row per document, one .bin cut into 21 shards
    rows = [stream[k * 2049 : (k + 1) * 2049].astype("<u2") for k in range(6)]
    (tree / "pythia").mkdir()
    document = write_megatron(tree / "pythia" / "document", rows, list(range(len(rows) + 1)))
    data = document.read_bytes()
    size = -(-len(data) // 21)
    for k in range(21):
        shard = tree / "pythia" / f"document-{k:05d}-of-00020.bin"
        shard.write_bytes(data[k * size : (k + 1) * size])

    vocab = TokenStore.open(build / "run" / "tokens" / "val").vocab_size
    for name in ("pythia-70m", "my-model"):
        _tiny_neox(tree / name, tokenizer, vocab)
    for name in ("tests", "queries", "pipeline"):
        (tree / name).symlink_to(REPO / name)
    # the demo's prebuilt models, copied (an example may write a folder of its own there)
    shutil.copytree(REPO / "demo-models", tree / "demo-models")
    for name, text in DOC_FILES.items():
        (tree / name).write_text(text)
    tiny = subprocess.run(
        [sys.executable, "tests/make_tiny_run.py", "runs/tiny"], cwd=tree, capture_output=True
    )
    assert tiny.returncode == 0, tiny.stderr
    return tree


@pytest.fixture
def tree(example_tree, tmp_path, monkeypatch) -> Path:
    copy = tmp_path / "tree"
    shutil.copytree(example_tree, copy, symlinks=True)
    monkeypatch.chdir(copy)
    return copy


# ---- running one -------------------------------------------------------------------------------


def _environment(tree: Path, context: tuple[str, ...]) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    env["HF_HOME"] = str(tree / ".hf-home")
    for line in context:  # NAME=$(...) lines, evaluated by bash as a reader's shell would
        name = ASSIGNMENT.match(line).group(1)
        out = subprocess.run(
            ["bash", "-c", f'{line}\nprintf %s "${name}"'],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        env[name] = out.stdout
    return env


def _argv(command: str, env: dict[str, str]) -> list[str]:
    text = re.sub(r"\$\{?([A-Z_][A-Z0-9_]*)\}?", lambda m: env.get(m.group(1), m.group(0)), command)
    return shlex.split(text, comments=True)


def _remove_output(argv: list[str], tree: Path) -> None:
    if "--out" not in argv:
        return
    out = (tree / argv[argv.index("--out") + 1]).resolve()
    assert out.is_relative_to(tree.resolve()), f"an example writes outside its tree: {out}"
    if out.is_dir():
        shutil.rmtree(out)
    elif out.exists():
        out.unlink()


def run_arslice(argv: list[str], example: Example, tree: Path, monkeypatch) -> None:
    from pipeline.cli import build_parser, main
    from pipeline.config import config_from_namespace

    if example.needs:
        parser, command = build_parser(argv[0])
        config_from_namespace(command.config_cls, parser.parse_args(argv[1:]))
        return
    if argv[:1] == ["run"] and "demo.toml" in " ".join(argv) and "--dry-run" not in argv:
        argv = [*argv, "--dry-run"]
    if argv[:1] == ["train"]:
        argv = [*argv, "--steps", TRAIN_STEPS]
        if "--keep-checkpoints" in argv:
            argv += TRAIN_KEEP
    if argv[:1] == ["mqar"]:
        argv = [*argv, *MQAR_TINY]
    _remove_output(argv, tree)
    assert main(argv) == 0, example.where


def run_make(argv: list[str], example: Example, tree: Path) -> None:
    from pipeline.runner.registry import stage_names

    targets = [a for a in argv[1:] if "=" not in a]
    variables = dict(a.split("=", 1) for a in argv[1:] if "=" in a)
    rules = (REPO / "Makefile").read_text()
    for target in targets:
        assert re.search(rf"^{re.escape(target)}:", rules, re.M), f"no make target {target}"
    config = variables.get("CONFIG", "pipeline/configs/demo.toml")
    assert (REPO / config).is_file(), config
    if example.needs:
        return
    pipeline_goals = {
        "all",
        "tokenizer",
        "tokenize",
        "counts",
        "tags",
        "train",
        "eval",
        "probe",
        "report",
    }
    if set(targets) & pipeline_goals:
        from pipeline.cli import main

        assert set(stage_names()) >= {"tokenize", "report"}
        assert main(["run", "--config", config, "--dry-run"]) == 0, example.where
    for target in set(targets) - pipeline_goals:
        out = subprocess.run(["make", "-n", target], cwd=REPO, capture_output=True, text=True)
        assert out.returncode == 0 and out.stdout.strip(), (example.where, out.stderr)


def run_shell(example: Example, tree: Path, monkeypatch) -> None:
    env = _environment(tree, example.context)
    for part in re.split(r"\s+&&\s+", example.text):
        argv = _argv(part, env)
        name = Path(argv[0]).name
        if name == "arslice":
            for key in (
                "PYTHONPATH",
                "HF_HUB_OFFLINE",
                "HF_HOME",
                *(c.split("=")[0] for c in example.context),
            ):
                monkeypatch.setenv(key, env[key])
            run_arslice(argv[1:], example, tree, monkeypatch)
        elif name == "make":
            run_make(argv, example, tree)
        else:
            flags = ["-n"] if example.needs else []
            out = subprocess.run(
                ["bash", *flags, "-c", part], cwd=tree, env=env, capture_output=True, text=True
            )
            assert out.returncode == 0, (example.where, out.stderr)


def run_transcript(example: Example, tree: Path) -> None:
    """`$ command` lines, each followed by what it prints: run in order, compared line by line.
    The tree starts without the directories a transcript makes."""
    for made in TRANSCRIPTS_MAKE:
        if made in example.text:
            shutil.rmtree(tree / made)
    env = _environment(tree, ())
    steps: list[tuple[str, list[str]]] = []
    for line in example.text.splitlines():
        if line.startswith("$ "):
            steps.append((line[2:], []))
        else:
            steps[-1][1].append(line)
    for command, shown in steps:
        argv = shlex.split(command)
        if argv[0] == "arslice":
            argv = [sys.executable, "-m", "pipeline.cli", *argv[1:]]
        elif argv[0] == "python":
            argv[0] = sys.executable
        out = subprocess.run(argv, cwd=tree, env=env, capture_output=True, text=True)
        assert out.returncode == 0, (example.where, command, out.stderr)
        got = [line.rstrip() for line in out.stdout.rstrip("\n").splitlines()]
        assert got == [line.rstrip() for line in shown], (example.where, command)


def run_python(example: Example, tree: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-c", example.text],
        cwd=tree,
        env=_environment(tree, ()),
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, (example.where, out.stderr)


def run_example(example: Example, tree: Path, monkeypatch) -> None:
    if example.kind == "python":
        run_python(example, tree)
    elif example.kind == "transcript":
        run_transcript(example, tree)
    else:
        run_shell(example, tree, monkeypatch)


# ---- the tests ---------------------------------------------------------------------------------


def test_the_examples_are_found():
    """The extraction sees the examples it is meant to (so a test per example is not vacuous):
    the README's own (install, the demo, the test command CI runs, evaluating a checkpoint) and
    those of the pages it moved to docs/."""
    readme = [e for e in DOCS if e.where.startswith("README.md:")]
    texts = " ".join(e.text for e in readme)
    for needle in ("make install", "make all", "make test", "arslice eval", "open_run"):
        assert needle in texts, needle
    assert "my-run.toml" in page_examples("README.md")[1]
    pages = {e.where.split(":")[0] for e in DOCS}
    assert {"docs/stages.md", "docs/results.md", "docs/cluster.md"} <= pages
    docs = " ".join(e.text for e in DOCS)
    for needle in ("arslice tag", "arslice count", "arslice query", "arslice train", "ray start"):
        assert needle in docs, needle
    assert any(e.kind == "transcript" for e in DOCS)
    helps = {e.where.split(":")[0] for e in HELP}
    assert {"arslice --help", "arslice tokenize --help", "arslice query --help"} <= helps
    assert all(e.context for e in HELP + DOCS if "$STDLIB" in e.text)  # defined where used
    assert len([e for e in HELP + DOCS if e.needs]) >= 10


def test_the_readme_links_every_page():
    """A page of docs/ (a file with a `# ` title; the others are tables a run wrote) is reached
    from the README, and every page the README links exists."""
    readme = (REPO / "README.md").read_text()
    linked = set(re.findall(r"\]\((docs/[^)#]+\.md)(?:#[^)]*)?\)", readme))
    pages = {p for p in DOC_PAGES[1:] if (REPO / p).read_text().startswith("# ")}
    assert pages <= linked, sorted(pages - linked)
    assert all((REPO / p).is_file() for p in linked), sorted(linked)
    assert {"docs/design.md", "docs/demo.md", "docs/stages.md"} <= pages


def _anchors(page: Path) -> set[str]:
    """The anchors of a page's headings, as GitHub makes them (lower case, punctuation dropped,
    spaces as hyphens)."""
    prose = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)  # not `# comments`
    titles = re.findall(r"^#+ (.+)$", prose, re.M)
    return {re.sub(r"[^\w\- ]", "", t.strip().lower()).replace(" ", "-") for t in titles}


def test_every_link_between_the_pages_resolves():
    """A relative link of the README or of a page of docs/ names a file that exists and, with a
    `#anchor`, a heading of that file: text moved between pages leaves no link behind."""
    broken = []
    for page in DOC_PAGES:
        text = (REPO / page).read_text()
        for target, anchor in re.findall(r"\]\(([^)#:\s]*)(?:#([^)\s]+))?\)", text):
            path = (REPO / page).parent / target if target else REPO / page
            if not path.exists():
                broken.append(f"{page}: {target}")
            elif anchor and anchor not in _anchors(path):
                broken.append(f"{page}: {target}#{anchor}")
    assert not broken, broken


def _assigned(path: Path, name: str) -> str:
    """The string a module assigns to NAME at its top level."""
    import ast

    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and [t.id for t in node.targets] == [name]:
            return ast.literal_eval(node.value)
    raise AssertionError(f"{path} assigns no {name}")


def test_generated_sections_are_where_their_writers_look():
    """`make readme-demo` rewrites each demo's table in the page the Makefile's DEMO_DOC names,
    from docs/<run>-table1.md, and a full `benchmarks/gpu_eval.py` the gpu-eval section of its
    PILE_PAGE: each section is there, and a demo's table is the one its table file holds."""
    page = re.search(r"^DEMO_DOC = (\S+)$", (REPO / "Makefile").read_text(), re.M)
    assert page, "the Makefile names no DEMO_DOC"
    text = (REPO / page[1]).read_text()
    for run in ("demo", "demo-stdlib"):
        table = (REPO / "docs" / f"{run}-table1.md").read_text().split("\n", 2)[2].strip()
        name = re.escape(run)
        section = re.search(
            rf"<!-- {name}-table:start[^>]*-->\n(.*?)\n<!-- {name}-table:end -->", text, re.S
        )
        assert section, f"{page[1]} has no {run}-table section"
        assert section[1] == table, f"{page[1]}'s {run} table is not docs/{run}-table1.md's"
    pile = _assigned(REPO / "benchmarks" / "gpu_eval.py", "PILE_PAGE")
    assert re.search(
        r"<!-- gpu-eval:start[^>]*-->\n.*?\n<!-- gpu-eval:end -->", (REPO / pile).read_text(), re.S
    )


@pytest.mark.parametrize("example", _params(DOCS))
def test_doc_example(example, tree, monkeypatch):
    run_example(example, tree, monkeypatch)


@pytest.mark.parametrize("example", _params(HELP))
def test_help_example(example, tree, monkeypatch):
    run_example(example, tree, monkeypatch)

"""The Hugging Face hub, when there is none: decide once whether it answers, and otherwise fail
in seconds with one message saying how to use a local directory instead.

Without this, every `from_pretrained` of a hub name on a machine without network retries for
half a minute and prints each warning twice before its own error. Here the hub is taken as
unreachable when `HF_HUB_OFFLINE` is set, or when one request to its endpoint (`HF_ENDPOINT`,
default https://huggingface.co, through the environment's proxy) gets no HTTP answer within
`PROBE_TIMEOUT_S`; the answer is kept for the process. A hub name already in the local cache
(`HF_HOME`, `HF_HUB_CACHE`) still loads offline: `files_only()` tells `from_pretrained` to read
the cache only.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable
from pathlib import Path

from ar_slicing.errors import ArSliceError

log = logging.getLogger(__name__)

DEFAULT_ENDPOINT = "https://huggingface.co"
PROBE_TIMEOUT_S = 5.0
_TRUE = {"1", "on", "yes", "true"}
_probed: dict[tuple[str | None, str], str | None] = {}


def endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "").rstrip("/") or DEFAULT_ENDPOINT


def unreachable() -> str | None:
    """Why the hub cannot be used now (None: it answered). Decided once per process for each
    setting of HF_HUB_OFFLINE and HF_ENDPOINT."""
    offline = os.environ.get("HF_HUB_OFFLINE")
    key = (offline, endpoint())
    if key not in _probed:
        if (offline or "").strip().lower() in _TRUE:
            _probed[key] = f"HF_HUB_OFFLINE={offline}"
        else:
            _probed[key] = _probe(endpoint())
            if _probed[key]:
                log.debug("the hub is not reachable: %s", _probed[key])
    return _probed[key]


def _probe(url: str) -> str | None:
    """None when `url` gives any HTTP answer within PROBE_TIMEOUT_S, else what happened. (The
    request runs in a thread so a name lookup that hangs cannot hold the caller longer.)"""
    import urllib.error
    import urllib.request

    outcome: list[str | None] = []

    def request() -> None:
        try:
            urllib.request.urlopen(
                urllib.request.Request(url, method="HEAD"), timeout=PROBE_TIMEOUT_S
            )
            outcome.append(None)
        except urllib.error.HTTPError:
            outcome.append(None)  # an answer, even an error status: the hub is there
        except (OSError, ValueError) as e:
            reason = getattr(e, "reason", e)
            outcome.append(f"{url} did not answer: {reason}")

    thread = threading.Thread(target=request, daemon=True)
    thread.start()
    thread.join(PROBE_TIMEOUT_S + 1)
    return outcome[0] if outcome else f"{url} did not answer within {PROBE_TIMEOUT_S:g} s"


def is_hub_name(target: str) -> bool:
    """True for a name only the hub (or its cache) can resolve: not an existing path, and not
    written as one (./x, /x, ~/x, x.json)."""
    target = str(target)
    if target.startswith((".", "/", "~")) or target.endswith(".json"):
        return False
    return not Path(target).expanduser().exists()


def split_revision(target: str) -> tuple[str, str | None]:
    """`"EleutherAI/pythia-160m@step3000"` -> `("EleutherAI/pythia-160m", "step3000")`: a hub id
    and the branch, tag or commit after its `@` (None: none given, the hub's default branch). An
    existing path, or one written as a path, is returned whole (a directory may hold an `@`)."""
    target = str(target)
    if "@" not in target or not is_hub_name(target):
        return target, None
    name, _, revision = target.partition("@")
    if not name or not revision or "@" in revision:
        raise ArSliceError(
            f"{target!r}: expected a hub id and one revision, ID@REVISION "
            "(e.g. EleutherAI/pythia-160m@step3000)"
        )
    return name, revision


def resolve_commit(repo_id: str, revision: str | None, what: str) -> str:
    """The commit `revision` (a branch, tag or commit of model repo `repo_id`; None: its default
    branch) names now: asked of the hub when it answers, else read from the local cache
    (`models--org--name/refs/<revision>`, or `snapshots/<commit>` for a commit). `what` names the
    spec in the messages."""
    why = unreachable()
    if why is None:
        try:
            from huggingface_hub import HfApi

            return HfApi(endpoint=endpoint()).model_info(repo_id, revision=revision).sha
        except Exception as e:
            raise ArSliceError(
                f"{what}: the hub has no revision {revision or 'main'!r} of {repo_id} "
                f"({type(e).__name__}: {e}); name a branch, tag or commit it has"
            ) from None
    try:
        from huggingface_hub import snapshot_download

        folder = snapshot_download(repo_id, revision=revision, local_files_only=True)
    except Exception:
        if not cached_revisions(repo_id):
            require([(what, repo_id, "model")])  # the usual message: nothing of it is cached
        raise ArSliceError(
            f"the Hugging Face hub is not reachable ({why}) and revision {revision or 'main'!r} "
            f"of {repo_id} is not in the local cache ({_cache_dir()}; it has "
            f"{', '.join(cached_revisions(repo_id)) or 'no named revision'}): {what}. Use one of "
            "those, or a local copy (`hf download NAME --revision REV --local-dir DIR`)"
        ) from None
    return Path(folder).name  # snapshots/<commit>


def cached_revisions(repo_id: str) -> list[str]:
    """The branch and tag names the local cache holds a commit for, for the messages."""
    refs = _cache_dir() / ("models--" + repo_id.replace("/", "--")) / "refs"
    if not refs.is_dir():
        return []
    return sorted(str(p.relative_to(refs)) for p in refs.rglob("*") if p.is_file())


def _cache_dir() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def is_cached(repo_id: str, repo_type: str = "model") -> bool:
    """True when a snapshot of `repo_id` (`ID@REVISION`: of that revision) is in the local hub
    cache."""
    try:
        from huggingface_hub import snapshot_download

        repo_id, revision = split_revision(repo_id)
        snapshot_download(repo_id, revision=revision, repo_type=repo_type, local_files_only=True)
        return True
    except Exception:  # not cached, or not a valid repo id
        return False


def files_only() -> dict:
    """`from_pretrained` keyword arguments: read the local cache only when the hub is unreachable
    (no retries), nothing otherwise. huggingface_hub is told the same: besides the files it
    would ask the hub for its agent registry, even with local_files_only."""
    offline = bool(unreachable())
    try:
        from huggingface_hub import constants
    except ImportError:
        pass
    else:
        constants.HF_HUB_OFFLINE = offline  # (read at each request, so it follows the probe)
    return {"local_files_only": True} if offline else {}


def require(names: Iterable[tuple[str, str, str]]) -> None:
    """Refuse, in one message, the hub names that cannot be loaded now: the hub is unreachable
    and they are not cached. `names` holds (what, name, repo_type) triples, e.g.
    ("model hf:gpt2 ([eval.models.gpt2])", "gpt2", "model"); a dataset ("dataset") is refused
    whenever the hub is unreachable, as streaming reads the hub itself."""
    names = list(names)
    if not names:
        return
    why = unreachable()
    if why is None:
        return
    missing: dict[tuple[str, str], list[str]] = {}  # one entry per name, however many need it
    for what, name, kind in names:
        if (name, kind) in missing or kind == "dataset" or not is_cached(name, kind):
            missing.setdefault((name, kind), []).append(what)
    if not missing:
        return
    repos = {split_revision(name)[0] for name, _ in missing}
    raise ArSliceError(
        f"the Hugging Face hub is not reachable ({why}) and not in the local cache "
        f"({len(repos)} {'repository' if len(repos) == 1 else 'repositories'}, "
        f"{len(missing)} {'name' if len(missing) == 1 else 'names'}): "
        + "; ".join(_uses(whats) for whats in missing.values())
        + ". Use a local copy instead: on a machine with network, `hf download NAME --local-dir "
        "DIR` (or save_pretrained), then name DIR in its place (hf:DIR, based:DIR, "
        '`pretrained = "DIR"`, --tokenizer DIR); for an hf:// dataset, download its files and '
        "pass them as sources"
    )


def _uses(whats: list[str]) -> str:
    """What needs one missing name, once per way it is named ("model hf:X (where)"), the other
    places that name it the same way counted: `arslice probe` reads every model `arslice eval`
    does, and would otherwise double the list."""
    firsts: dict[str, list[str]] = {}
    for what in whats:
        firsts.setdefault(what.split(" (")[0], []).append(what)
    return "; ".join(
        uses[0] + (f" and {len(uses) - 1} more use of it" if len(uses) > 1 else "")
        for uses in firsts.values()
    )


def fetch(repo_id: str, revision: str | None, patterns: list[str], spec: str, instead: str) -> Path:
    """The local folder of hub repo `repo_id` at `revision` holding the files that match
    `patterns`: fetched when the hub answers, read from the cache when it does not (`require`
    refuses first when they are not cached). One line on failure, naming `spec` and what to pass
    `instead` (e.g. "the downloaded model.pt")."""
    require([(spec, f"{repo_id}@{revision}" if revision else repo_id, "model")])
    try:
        from huggingface_hub import snapshot_download

        return Path(
            snapshot_download(repo_id, revision=revision, allow_patterns=patterns, **files_only())
        )
    except Exception as e:
        raise ArSliceError(
            f"{spec}: could not fetch {repo_id} from the hub ({type(e).__name__}: {e}); pass "
            f"{instead}"
        ) from None

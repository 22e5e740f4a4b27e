"""Hub ids to local snapshot folders, through huggingface_hub.

`download_snapshot` pins the revision (a branch or tag) to its commit once,
lists the repo at that commit, and downloads only what the load reads
(hub_files.py) at that commit, so a branch that moves mid-download cannot mix
two commits. huggingface_hub itself honours HF_HOME / HF_HUB_CACHE,
HF_TOKEN, HF_ENDPOINT and HF_HUB_OFFLINE, and draws its progress bars on
stderr. With HF_HUB_OFFLINE=1 the cached snapshot of the revision loads
without a request. Each failure is a HubModelError naming the repo and what
to do about it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from pagedllm.core.errors import PagedLLMError
from pagedllm.model_registry.hub_files import files_to_download

if TYPE_CHECKING:
    from huggingface_hub import HfApi
    from huggingface_hub._revision import ResolvedRevision

# huggingface_hub's repo id shape: "name" or "org/name", letters, digits, - _ .
_REPO_ID = re.compile(r"^(?:[\w.-]+/)?[\w.-]+$")


class HubModelError(PagedLLMError):
    """A hub id that cannot be downloaded or found in the cache."""

    def __init__(self, repo_id: str, revision: str | None, reason: str) -> None:
        self.repo_id = repo_id
        self.revision = revision
        at = f" at revision {revision!r}" if revision else ""
        super().__init__(f"cannot load hub model {repo_id!r}{at}: {reason}")


def looks_like_hub_id(name: str) -> bool:
    """`org/name` (or `name`) that is not an existing local path."""
    return bool(_REPO_ID.match(name)) and ".." not in name and not os.path.exists(name)


def download_snapshot(
    repo_id: str, revision: str | None, cache_dir: str | None, load_format: str, *, tokenizer_only: bool = False
) -> str:
    """The local snapshot folder of `repo_id` at `revision`, holding the
    files a load reads (`tokenizer_only`: configs and tokenizer files)."""
    from huggingface_hub import HfApi, constants

    api = HfApi()
    try:
        if constants.HF_HUB_OFFLINE:
            return _cached_snapshot(api, repo_id, revision, cache_dir)
        pinned = api.resolve_revision(repo_id, revision=revision, cache_dir=cache_dir)
        return _download_pinned(api, repo_id, pinned, cache_dir, load_format, tokenizer_only)
    except Exception as exc:
        raise _hub_error(exc, repo_id, revision, cache_dir) from exc


def _download_pinned(
    api: HfApi, repo_id: str, pinned: ResolvedRevision, cache_dir: str | None, load_format: str, tokenizer_only: bool
) -> str:
    from huggingface_hub import snapshot_download

    info = api.model_info(repo_id, revision=pinned.resolved)
    repo_files = [sibling.rfilename for sibling in info.siblings or ()]
    wanted = files_to_download(repo_files, load_format, tokenizer_only=tokenizer_only)
    if "config.json" not in wanted and not tokenizer_only:
        raise HubModelError(repo_id, pinned.initial, "the repo has no config.json (not a transformers model repo)")
    # NOTE: `pinned` carries the commit: every file is fetched at that commit.
    return str(snapshot_download(repo_id, revision=pinned, cache_dir=cache_dir, allow_patterns=wanted))


def _cached_snapshot(api: HfApi, repo_id: str, revision: str | None, cache_dir: str | None) -> str:
    """HF_HUB_OFFLINE=1: the cached snapshot the revision last resolved to."""
    from huggingface_hub import try_to_load_from_cache

    pinned = api.resolve_revision(repo_id, revision=revision, cache_dir=cache_dir, local_files_only=True)
    config = try_to_load_from_cache(repo_id, "config.json", cache_dir=cache_dir, revision=pinned.resolved)
    if not isinstance(config, str):
        raise _not_cached(repo_id, revision, cache_dir)
    return str(Path(config).parent)


def _not_cached(repo_id: str, revision: str | None, cache_dir: str | None) -> HubModelError:
    from huggingface_hub import constants

    where = cache_dir or constants.HF_HUB_CACHE
    return HubModelError(repo_id, revision, (
        f"it is not in the cache at {where} and HF_HUB_OFFLINE is set; unset HF_HUB_OFFLINE to download it, "
        "or point HF_HOME / --download-dir at the cache that holds it"
    ))


def _hub_error(exc: Exception, repo_id: str, revision: str | None, cache_dir: str | None) -> Exception:
    """What to tell the user for each of huggingface_hub's failures."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
        RevisionResolutionError,
    )

    if isinstance(exc, HubModelError):
        return exc
    if isinstance(exc, GatedRepoError):  # NOTE: a subclass of RepositoryNotFoundError: first
        return HubModelError(repo_id, revision, (
            f"the repo is gated; accept its terms on {constants.ENDPOINT}/{repo_id} and set HF_TOKEN "
            "(or run `hf auth login`) with a token of an account that has access"
        ))
    if isinstance(exc, RepositoryNotFoundError):
        # A bare name may be a misspelt folder or model source name rather than a repo.
        also = "" if "/" in repo_id else " (nor is it a local folder or a model source's name)"
        return HubModelError(repo_id, revision, (
            f"no such repo on {constants.ENDPOINT} (or it is private){also}; check the id, "
            "or set HF_TOKEN to a token with access for a private repo"
        ))
    if isinstance(exc, RevisionNotFoundError):
        return HubModelError(repo_id, revision, "the repo has no such branch, tag or commit; check --revision")
    if isinstance(exc, (LocalEntryNotFoundError, OfflineModeIsEnabled, RevisionResolutionError)):
        if constants.HF_HUB_OFFLINE:
            return _not_cached(repo_id, revision, cache_dir)
        return _unreachable(exc, repo_id, revision)
    if isinstance(exc, OSError) or type(exc).__module__.startswith("httpx"):  # the network failed mid-way
        return _unreachable(exc, repo_id, revision)
    return exc


def _unreachable(exc: Exception, repo_id: str, revision: str | None) -> HubModelError:
    from huggingface_hub import constants

    return HubModelError(repo_id, revision, (
        f"the hub at {constants.ENDPOINT} cannot be reached and the model is not cached ({type(exc).__name__}); "
        "check the network or HF_ENDPOINT, or set HF_HUB_OFFLINE=1 to load a cached snapshot"
    ))

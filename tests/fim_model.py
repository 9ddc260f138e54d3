"""Copies of SmolLM2 that have fill-in-the-middle tokens.

SmolLM2's vocabulary has none that llama.cpp reads as FIM prefix, suffix and middle (it
finds only `<reponame>`, as fim_rep), so no starter can infill. gguf-new-metadata names
three of its unused StarCoder-era control tokens as them; the repo-level copy names
`<repo_name>` and `<file_sep>` as fim_rep and fim_sep too. The model was never trained
on them, so its completions mean nothing: the tests compare it token for token with
llama.cpp, which is all they need."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

FIM = ("--special-token", "fim_pre", "<gh_stars>", "--special-token", "fim_suf",
       "<issue_start>", "--special-token", "fim_mid", "<issue_comment>")
REPO = ("--special-token", "fim_rep", "<repo_name>", "--special-token", "fim_sep", "<file_sep>")


def write_fim_gguf(source: Path, target: Path, repo: bool = False) -> Path:
    """`source` (SmolLM2's GGUF) copied to `target` with FIM tokens (and fim_rep/fim_sep)."""
    tool = Path(sys.executable).parent / "gguf-new-metadata"
    args = [str(tool), *FIM, *(REPO if repo else ()), "--force", str(source), str(target)]
    subprocess.run(args, check=True, capture_output=True, timeout=300)
    return target

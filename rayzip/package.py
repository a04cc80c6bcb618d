"""What ``rayzip submit --working-dir`` ships to the cluster, and what it never ships.

Everything under the directory, except:

* what ``.gitignore`` and ``.rayignore`` files exclude (each relative to its own directory;
  the deepest file with an opinion on a path decides, so ``!pattern`` in a subdirectory
  re-includes what a parent excluded);
* what Ray and Python tools leave behind (:data:`ALWAYS_EXCLUDED`: ``.git``, virtual
  environments, caches);
* symlinks that lead out of the directory: they are left out and reported. A symlink to a
  file inside is shipped as that file; symlinked directories are not followed.

A file that looks like a credential (a Ray auth token, ``.env``, SSH or TLS keys, cloud
credentials, or any file whose contents are this machine's Ray token) and that nothing
excludes stops the submission with :class:`SecretFileError` naming it: ignore it or move
it, rayzip does not guess.

Usage::

    shipped = package_working_dir(Path("mycode"), Path(tmp))   # relative paths copied
"""

from __future__ import annotations

import fnmatch
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pathspec

__all__ = ["ALWAYS_EXCLUDED", "Package", "SecretFileError", "package_working_dir"]

ALWAYS_EXCLUDED = (".git/", ".hg/", ".svn/", ".venv/", "venv/", "__pycache__/", "*.pyc", ".pytest_cache/",
                   ".mypy_cache/", ".ruff_cache/", ".ipynb_checkpoints/", "node_modules/", ".DS_Store")
IGNORE_FILES = (".gitignore", ".rayignore")
SECRET_NAMES = ("auth_token", ".env", ".env.*", "*.env", "*.pem", "*.key", "*.p12", "*.pfx", "id_rsa*", "id_dsa*",
                "id_ecdsa*", "id_ed25519*", ".netrc", ".pgpass", ".npmrc", ".pypirc", "credentials",
                "credentials.json", "service-account*.json", ".git-credentials", "kubeconfig", "*.kubeconfig")
SECRET_DIRS = (".ray", ".ssh", ".aws", ".gnupg", ".kube", ".docker")
_TOKEN_SCAN_BYTES = 1 << 16  # files up to this size are compared with the Ray token


class SecretFileError(ValueError):
    """A file that looks like a credential would have been shipped."""


@dataclass
class Package:
    files: list[str] = field(default_factory=list)  # relative paths copied
    nbytes: int = 0
    left_out_links: list[str] = field(default_factory=list)  # symlinks out of the directory


def _ray_tokens() -> list[bytes]:
    tokens = []
    if os.environ.get("RAY_AUTH_TOKEN"):
        tokens.append(os.environ["RAY_AUTH_TOKEN"].strip().encode())
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH", Path.home() / ".ray" / "auth_token"))
    try:
        text = path.read_bytes().strip()
        if text:
            tokens.append(text)
    except OSError:
        pass
    return [t for t in tokens if len(t) >= 16]


def _secret_reason(rel: str, path: Path, tokens: list[bytes]) -> str | None:
    parts = rel.split("/")
    if any(part in SECRET_DIRS for part in parts[:-1]):
        return f"it lies in a {'/'.join(p for p in parts[:-1] if p in SECRET_DIRS)} directory"
    if any(fnmatch.fnmatch(parts[-1], pattern) for pattern in SECRET_NAMES):
        return "its name is that of a credential file"
    if tokens:
        try:
            if path.stat().st_size <= _TOKEN_SCAN_BYTES:
                data = path.read_bytes()
                if any(token in data for token in tokens):
                    return "it holds this machine's Ray auth token"
        except OSError:
            pass
    return None


class _Ignores:
    """The ignore files seen on the way down, deepest last."""

    def __init__(self, root: Path):
        self.root = root
        self.always = pathspec.GitIgnoreSpec.from_lines(ALWAYS_EXCLUDED)
        self.specs: dict[str, pathspec.GitIgnoreSpec] = {}  # by directory, "" for the root

    def read(self, rel_dir: str) -> None:
        lines = []
        for name in IGNORE_FILES:
            path = self.root / rel_dir / name
            if path.is_file() and not path.is_symlink():
                lines += path.read_text(errors="replace").splitlines()
        if lines:
            self.specs[rel_dir] = pathspec.GitIgnoreSpec.from_lines(lines)

    def ignored(self, rel: str, is_dir: bool) -> bool:
        key = rel + "/" if is_dir else rel
        if self.always.match_file(key):
            return True
        # The deepest ignore file with an opinion on the path decides.
        for rel_dir in sorted((d for d in self.specs if not d or rel.startswith(d + "/")), key=len, reverse=True):
            verdict = self.specs[rel_dir].check_file(key[len(rel_dir) + 1:] if rel_dir else key).include
            if verdict is not None:
                return verdict
        return False


def package_working_dir(src: Path, dest: Path) -> Package:
    """Copy what may be shipped from ``src`` into ``dest`` (see the module docstring)."""
    src = src.resolve()
    if not src.is_dir():
        raise FileNotFoundError(f"--working-dir {src} is not a directory")
    ignores = _Ignores(src)
    tokens = _ray_tokens()
    package = Package()
    for current, dirs, files in os.walk(src, followlinks=False):
        rel_dir = os.path.relpath(current, src).replace(os.sep, "/")
        rel_dir = "" if rel_dir == "." else rel_dir
        ignores.read(rel_dir)
        keep_dirs = []
        for name in sorted(dirs):
            rel = f"{rel_dir}/{name}" if rel_dir else name
            path = Path(current) / name
            if ignores.ignored(rel, is_dir=True):
                continue
            if path.is_symlink():  # not followed: inside or out, a directory link is left out
                package.left_out_links.append(rel)
                continue
            keep_dirs.append(name)
        dirs[:] = keep_dirs
        for name in sorted(files):
            rel = f"{rel_dir}/{name}" if rel_dir else name
            path = Path(current) / name
            if ignores.ignored(rel, is_dir=False):
                continue
            if path.is_symlink():
                target = path.resolve()
                if not target.is_file() or not target.is_relative_to(src) or ignores.ignored(
                        target.relative_to(src).as_posix(), is_dir=False):
                    package.left_out_links.append(rel)
                    continue
            reason = _secret_reason(rel, path, tokens)
            if reason:
                raise SecretFileError(f"refusing to ship {rel} from {src}: {reason}. Remove it, or list it in "
                                      ".gitignore or .rayignore")
            out = dest / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, out)  # the content, never a link
            package.files.append(rel)
            package.nbytes += out.stat().st_size
    return package

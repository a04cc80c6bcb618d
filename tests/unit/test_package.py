"""What `rayzip submit --working-dir` ships (issue 16): ignore files honoured, no symlink
out of the directory, credentials refused before anything is sent."""

from __future__ import annotations

from pathlib import Path

import pytest

from rayzip.package import SecretFileError, package_working_dir


def _tree(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_ignore_files_and_symlinks(tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "no-token"))
    src, outside = tmp_path / "code", tmp_path / "outside"
    _tree(src, {"train.py": "x = 1\n", ".gitignore": "data/\n*.log\n!keep.log\n", "data/big.bin": "0" * 100,
                "run.log": "noise", "keep.log": "kept", "pkg/mod.py": "y = 2\n", "pkg/.rayignore": "scratch.py\n",
                "pkg/scratch.py": "z\n", ".git/config": "[core]\n", "pkg/__pycache__/mod.cpython-311.pyc": "b",
                ".venv/bin/python": "#!"})
    _tree(outside, {"passwd": "root:x:0:0\n", "dir/file": "f"})
    (src / "escape").symlink_to(outside / "passwd")
    (src / "escape_dir").symlink_to(outside / "dir")
    (src / "alias.py").symlink_to(src / "train.py")
    dest = tmp_path / "dest"
    package = package_working_dir(src, dest)
    assert sorted(package.files) == [".gitignore", "alias.py", "keep.log", "pkg/.rayignore", "pkg/mod.py", "train.py"]
    assert sorted(package.left_out_links) == ["escape", "escape_dir"]
    assert not (dest / "alias.py").is_symlink() and (dest / "alias.py").read_text() == "x = 1\n"
    assert sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file()) == sorted(package.files)


@pytest.mark.parametrize("rel", [".env", "config/.env.production", "auth_token", ".ray/session.json",
                                 "keys/id_ed25519", "certs/server.pem", ".aws/credentials"])
def test_credential_files_are_refused_unless_ignored(tmp_path, monkeypatch, rel):
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "no-token"))
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    src = tmp_path / "code"
    _tree(src, {"train.py": "", rel: "SECRET=1\n"})
    with pytest.raises(SecretFileError, match=f"refusing to ship {rel}"):
        package_working_dir(src, tmp_path / "dest")
    (src / ".gitignore").write_text(rel + "\n")
    assert "train.py" in package_working_dir(src, tmp_path / "dest2").files


def test_a_file_holding_the_ray_token_is_refused(tmp_path, monkeypatch):
    token = "f" * 64
    monkeypatch.setenv("RAY_AUTH_TOKEN", token)
    src = tmp_path / "code"
    _tree(src, {"train.py": "", "notes.txt": f"the cluster token is {token}\n"})
    with pytest.raises(SecretFileError, match="notes.txt .*holds this machine's Ray auth token"):
        package_working_dir(src, tmp_path / "dest")

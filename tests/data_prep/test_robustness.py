"""Corrupt and mismatched shard builds, and safe loading.

Every fault below is injected into a copy of a real build. ``ShardDataset`` (what the trainer opens) must refuse
it with a ``ShardError`` naming the file, either on open (manifest, vocab, sizes, headers: cheap, no shard data
read) or in ``verify()`` (sha256 of every byte: the only way to see bytes changed inside a shard), and
``python -m data_prep.inspect DIR --verify`` must exit non-zero naming the same file.
"""
from __future__ import annotations

import ast
import json
import pickle
import re
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

import data_prep
from data_prep import inspect as inspect_cli, shard_format
from data_prep.build import build
from data_prep.config import BuildConfig
from data_prep.instances import InstanceConfig
from data_prep.records import SourceError
from data_prep.shard_format import (
    FORMAT_VERSION,
    HEADER_BYTES,
    INDEX_DTYPE,
    MANIFEST_NAME,
    VOCAB_NAME,
    ShardArrays,
    ShardDataset,
    ShardError,
    ShardFile,
    write_shard,
)
from data_prep.sources import read_documents
from data_prep.vocab import VocabError, load_vocab

SHARD = "shard-00001.bin"  # the shard the faults hit (a build has at least two)


@pytest.fixture(scope="module")
def other_vocab_shards(samples_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A build of other text with another vocab (the uncased 30,522-entry MiniLM one)."""
    corpus = tmp_path_factory.mktemp("other_corpus") / "news.txt"
    corpus.write_text("\n\n".join((samples_dir / "news/lee.txt").read_text().split("\n\n")[:40]) + "\n")
    vocab = samples_dir / "minilm/vocab.txt"
    cfg = BuildConfig(inputs=(str(corpus),), vocab_path=str(vocab), vocab_sha256=load_vocab(vocab).sha256,
                      uncased=True, instances=InstanceConfig(max_seq_len=64), samples_per_shard=400)
    out = tmp_path_factory.mktemp("other_vocab_shards")
    build(cfg, out, progress=False)
    return out


def _section_starts(path: Path) -> dict[str, int]:
    """Byte offset of each section of a shard (the layout of docs/shard_format.md)."""
    _, _, width, num_samples, num_tokens, num_masked = struct.unpack_from("<8sIIQQQ", path.read_bytes())
    starts, offset = {}, HEADER_BYTES
    for name, nbytes in [("index", num_samples * INDEX_DTYPE.itemsize), ("tokens", num_tokens * width),
                         ("masked_positions", num_masked * 2), ("masked_labels", num_masked * width)]:
        starts[name] = offset
        offset += (nbytes + 7) // 8 * 8
    return starts


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x5A
    path.write_bytes(bytes(data))


@dataclass(frozen=True)
class Copy:
    """The build copy a fault edits, and the other builds it may borrow files from."""

    directory: Path
    bert: Path
    other_vocab: Path
    monkeypatch: pytest.MonkeyPatch

    @property
    def shard(self) -> Path:
        return self.directory / SHARD

    def section(self, name: str) -> int:
        return _section_starts(self.shard)[name]

    def edit_manifest(self, edit: Callable[[dict], object]) -> None:
        path = self.directory / MANIFEST_NAME
        manifest = json.loads(path.read_text())
        edit(manifest)
        path.write_text(json.dumps(manifest))

    def swap(self, source: Path, patch_manifest: bool = False) -> None:
        """Copy another build's shard over ours; ``patch_manifest``: a careless merge that fixes size and counts."""
        if source != self.shard:
            shutil.copyfile(source, self.shard)
        if patch_manifest:
            samples = len(ShardFile(self.shard))
            self.edit_manifest(lambda m: (_entry(m).update(bytes=self.shard.stat().st_size, num_samples=samples),
                                          m.update(num_samples=sum(e["num_samples"] for e in m["shards"]))))

    def rewrite(self, dtype: str | None = None, version: int | None = None) -> None:
        """Write our shard's samples again with another token width or FORMAT_VERSION, as another build would."""
        arrays = ShardFile(self.shard).arrays
        dtype = np.dtype(dtype or arrays.tokens.dtype)
        copy = ShardArrays(np.array(arrays.index), np.array(arrays.tokens).astype(dtype),
                           np.array(arrays.masked_positions), np.array(arrays.masked_labels).astype(dtype))
        with self.monkeypatch.context() as patch:
            if version is not None:
                patch.setattr(shard_format, "FORMAT_VERSION", version)
            write_shard(self.shard, copy)


def _entry(manifest: dict, name: str = SHARD) -> dict:
    return next(e for e in manifest["shards"] if e["file"] == name)


def _truncate(path: Path, size: int) -> None:
    path.write_bytes(path.read_bytes()[:size])


def _not_a_shard(c: Copy) -> None:
    np.save(c.directory / "x.npy", np.arange(5000))
    shutil.move(c.directory / "x.npy", c.shard)


# (fault, how to inject it, the file the error must name, where it is caught: "open" or only "verify")
FAULTS: list[tuple[str, Callable[[Copy], object], str, str]] = [
    # header fields: all checked on open
    ("magic_flipped", lambda c: _flip(c.shard, 0), SHARD, "open"),
    ("version_flipped", lambda c: _flip(c.shard, 8), SHARD, "open"),
    ("token_width_flipped", lambda c: _flip(c.shard, 12), SHARD, "open"),
    ("num_samples_flipped", lambda c: _flip(c.shard, 16), SHARD, "open"),
    ("num_tokens_flipped", lambda c: _flip(c.shard, 24), SHARD, "open"),
    ("num_masked_flipped", lambda c: _flip(c.shard, 32), SHARD, "open"),
    ("header_padding_flipped", lambda c: _flip(c.shard, 50), SHARD, "open"),
    # data bytes: same size and a valid header, so only the sha256 can see them
    ("index_byte_flipped", lambda c: _flip(c.shard, c.section("index") + 40), SHARD, "verify"),
    ("token_byte_flipped", lambda c: _flip(c.shard, c.section("tokens") + 101), SHARD, "verify"),
    ("masked_position_flipped", lambda c: _flip(c.shard, c.section("masked_positions") + 6), SHARD, "verify"),
    ("masked_label_flipped", lambda c: _flip(c.shard, c.shard.stat().st_size - 9), SHARD, "verify"),
    # sizes
    ("truncated_by_one_byte", lambda c: _truncate(c.shard, c.shard.stat().st_size - 1), SHARD, "open"),
    ("truncated_to_half", lambda c: _truncate(c.shard, c.shard.stat().st_size // 2), SHARD, "open"),
    ("truncated_inside_header", lambda c: _truncate(c.shard, 20), SHARD, "open"),
    ("truncated_to_zero", lambda c: _truncate(c.shard, 0), SHARD, "open"),
    ("bytes_appended", lambda c: c.shard.write_bytes(c.shard.read_bytes() + bytes(8)), SHARD, "open"),
    ("deleted", lambda c: c.shard.unlink(), SHARD, "open"),
    ("replaced_by_directory", lambda c: (c.shard.unlink(), c.shard.mkdir()), SHARD, "open"),
    # shards of other builds
    ("swapped_other_recipe", lambda c: c.swap(c.bert / SHARD), SHARD, "open"),
    ("swapped_other_vocab", lambda c: c.swap(c.other_vocab / "shard-00000.bin"), SHARD, "open"),
    ("swapped_other_vocab_manifest_patched", lambda c: c.swap(c.other_vocab / "shard-00000.bin", True), SHARD,
     "verify"),
    ("swapped_uint32_manifest_patched", lambda c: (c.rewrite(dtype="<u4"), c.swap(c.shard, True)), SHARD, "open"),
    ("swapped_other_format_version", lambda c: c.rewrite(version=FORMAT_VERSION + 1), SHARD, "open"),
    ("swapped_not_a_shard", _not_a_shard, SHARD, "open"),
    ("vocab_swapped", lambda c: shutil.copyfile(c.other_vocab / VOCAB_NAME, c.directory / VOCAB_NAME), VOCAB_NAME,
     "open"),
    ("vocab_one_token_edited", lambda c: (c.directory / VOCAB_NAME).write_text(
        (c.directory / VOCAB_NAME).read_text().replace("\nthe\n", "\nThe_\n", 1)), VOCAB_NAME, "open"),
    # manifest edits
    ("manifest_deleted", lambda c: (c.directory / MANIFEST_NAME).unlink(), MANIFEST_NAME, "open"),
    ("manifest_truncated_json", lambda c: _truncate(c.directory / MANIFEST_NAME, 200), MANIFEST_NAME, "open"),
    ("manifest_empty", lambda c: _truncate(c.directory / MANIFEST_NAME, 0), MANIFEST_NAME, "open"),
    ("manifest_not_utf8", lambda c: (c.directory / MANIFEST_NAME).write_bytes(b"\xff\xfe{}"), MANIFEST_NAME, "open"),
    ("manifest_a_list", lambda c: (c.directory / MANIFEST_NAME).write_text("[]"), MANIFEST_NAME, "open"),
    ("manifest_a_pickle", lambda c: (c.directory / MANIFEST_NAME).write_bytes(pickle.dumps({"format": "x"})),
     MANIFEST_NAME, "open"),
    ("manifest_other_version", lambda c: c.edit_manifest(lambda m: m.update(format_version=2)), MANIFEST_NAME, "open"),
    ("manifest_other_format", lambda c: c.edit_manifest(lambda m: m.update(format="mds")), MANIFEST_NAME, "open"),
    ("manifest_missing_shards", lambda c: c.edit_manifest(lambda m: m.pop("shards")), MANIFEST_NAME, "open"),
    ("manifest_missing_vocab", lambda c: c.edit_manifest(lambda m: m.pop("vocab")), MANIFEST_NAME, "open"),
    ("manifest_missing_token_dtype", lambda c: c.edit_manifest(lambda m: m.pop("token_dtype")), MANIFEST_NAME, "open"),
    ("manifest_missing_special_tokens", lambda c: c.edit_manifest(lambda m: m["vocab"].pop("special_tokens")),
     MANIFEST_NAME, "open"),
    ("manifest_shards_not_a_list", lambda c: c.edit_manifest(lambda m: m.update(shards={"a": 1})), MANIFEST_NAME,
     "open"),
    ("manifest_entry_missing_sha256", lambda c: c.edit_manifest(lambda m: _entry(m).pop("sha256")), MANIFEST_NAME,
     "open"),
    ("manifest_entry_count_a_string", lambda c: c.edit_manifest(lambda m: _entry(m).update(num_samples="9")),
     MANIFEST_NAME, "open"),
    ("manifest_path_outside_build", lambda c: c.edit_manifest(lambda m: _entry(m).update(file="../x.bin")),
     MANIFEST_NAME, "open"),
    ("manifest_total_count_wrong", lambda c: c.edit_manifest(lambda m: m.update(num_samples=m["num_samples"] + 1)),
     MANIFEST_NAME, "open"),
    ("manifest_token_dtype_unknown", lambda c: c.edit_manifest(lambda m: m.update(token_dtype="float32")),
     MANIFEST_NAME, "open"),
    ("manifest_token_dtype_wrong", lambda c: c.edit_manifest(lambda m: m.update(token_dtype="uint32")),
     "shard-00000.bin", "open"),
    ("manifest_shard_count_wrong", lambda c: c.edit_manifest(lambda m: (
        _entry(m).update(num_samples=_entry(m)["num_samples"] + 1), m.update(num_samples=m["num_samples"] + 1))),
     SHARD, "open"),
    ("manifest_shard_bytes_wrong", lambda c: c.edit_manifest(lambda m: _entry(m).update(bytes=5)), SHARD, "open"),
    ("manifest_shard_sha256_wrong", lambda c: c.edit_manifest(lambda m: _entry(m).update(sha256="0" * 64)), SHARD,
     "verify"),
    ("manifest_lists_absent_shard", lambda c: c.edit_manifest(lambda m: (
        m["shards"].append(dict(_entry(m), file="shard-00099.bin")),
        m.update(num_samples=m["num_samples"] + _entry(m)["num_samples"]))), "shard-00099.bin", "open"),
]


@pytest.fixture
def build_copy(unilm_shards: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "build"
    shutil.copytree(unilm_shards, copy)
    return copy


@pytest.mark.parametrize("fault, inject, named, stage", FAULTS, ids=[f[0] for f in FAULTS])
def test_fault_is_refused_naming_the_file(fault, inject, named, stage, build_copy, bert_shards, other_vocab_shards,
                                          monkeypatch):
    assert len(ShardDataset(build_copy).shards) >= 2
    inject(Copy(build_copy, bert_shards, other_vocab_shards, monkeypatch))
    path = re.escape(str(build_copy / named))
    if stage == "open":
        with pytest.raises(ShardError, match=path):
            ShardDataset(build_copy)
    else:
        ds = ShardDataset(build_copy)  # same sizes and headers: opening cannot tell
        with pytest.raises(ShardError, match=f"sha256 mismatch.*{path}"):
            ds.verify()
    with pytest.raises(SystemExit) as exit_info:
        inspect_cli.main([str(build_copy), "--verify", "--json"])
    assert exit_info.value.code not in (0, None) and str(build_copy / named) in str(exit_info.value.code)


def test_inspect_cli_exit_status_names_the_file(build_copy):
    """The real command line, once for an open-time fault and once for a verify-only one."""
    command = [sys.executable, "-m", "data_prep.inspect", str(build_copy), "--verify"]
    _flip(build_copy / SHARD, _section_starts(build_copy / SHARD)["tokens"] + 3)
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 1 and f"sha256 mismatch (modified or corrupt): {build_copy / SHARD}" in result.stderr
    _flip(build_copy / "shard-00000.bin", 0)
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 1 and f"{build_copy / 'shard-00000.bin'}: not a shard" in result.stderr


def test_corrupt_index_entry_is_named_when_read(build_copy):
    """A flipped offset that points outside the file: reading that sample names the shard, never reads elsewhere."""
    shard = build_copy / SHARD
    data = bytearray(shard.read_bytes())
    data[HEADER_BYTES:HEADER_BYTES + 8] = struct.pack("<Q", 1 << 40)  # token_offset of its first sample
    shard.write_bytes(bytes(data))
    ds = ShardDataset(build_copy)
    first = len(ds.shards[0])
    with pytest.raises(ShardError, match=re.escape(f"{shard}: sample 0 points outside the file")):
        ds[first]
    ds[first + 1]  # the other samples still read


def test_open_hashes_no_shard(build_copy, monkeypatch):
    """Open-time checks stay cheap: shard headers and sizes only; the one file hashed is the small vocab."""
    hashed: list[str] = []
    real = shard_format.sha256_file
    monkeypatch.setattr(shard_format, "sha256_file", lambda path: hashed.append(Path(path).name) or real(path))
    ShardDataset(build_copy)
    assert hashed == [VOCAB_NAME]


# --- safe loading ---------------------------------------------------------------------------------------------------

class _Tripwire:
    """Unpickling this creates ``path``: proof that something unpickled a file."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return Path.touch, (self.path,)


def test_pickles_on_disk_are_never_unpickled(build_copy, tmp_path):
    pickle.loads(pickle.dumps(_Tripwire(tmp_path / "armed")))
    assert (tmp_path / "armed").exists()  # the tripwire works
    tripwire = tmp_path / "unpickled"
    payload = pickle.dumps(_Tripwire(tripwire))
    (build_copy / SHARD).write_bytes(payload)
    with pytest.raises(ShardError, match=SHARD):
        ShardDataset(build_copy)
    (build_copy / MANIFEST_NAME).write_bytes(payload)
    with pytest.raises(ShardError, match=MANIFEST_NAME):
        ShardDataset(build_copy)
    (tmp_path / "vocab.txt").write_bytes(payload)
    with pytest.raises(VocabError):
        load_vocab(tmp_path / "vocab.txt")
    for suffix in (".txt", ".jsonl", ".json"):  # corpus files are only ever decoded as text
        (tmp_path / f"corpus{suffix}").write_bytes(payload)
        try:
            list(read_documents(str(tmp_path / f"corpus{suffix}")))
        except SourceError:
            pass
    assert not tripwire.exists()


def test_xml_external_entities_and_entity_bombs_are_not_expanded(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP SECRET CONTENT")
    xxe = tmp_path / "xxe.xml"
    xxe.write_text(f'<?xml version="1.0"?>\n<!DOCTYPE m [<!ENTITY e SYSTEM "file://{secret}">]>\n'
                   "<mediawiki><page><title>A</title><ns>0</ns><revision><text>Leak: &e;. Second sentence here."
                   "</text></revision></page></mediawiki>\n")
    try:
        records = list(read_documents(str(xxe)))
    except SourceError as err:
        records = [str(err)]
    assert not any("TOP SECRET" in str(r) for r in records)
    bomb = tmp_path / "bomb.xml"
    entities = '<!ENTITY a0 "lol lol lol lol lol lol lol lol lol lol">' + "".join(
        f'<!ENTITY a{i} "{f"&a{i - 1};" * 10}">' for i in range(1, 10))
    bomb.write_text(f'<?xml version="1.0"?>\n<!DOCTYPE m [{entities}]>\n<mediawiki><page><title>B</title><ns>0</ns>'
                    "<revision><text>&a9;</text></revision></page></mediawiki>\n")
    with pytest.raises(SourceError, match=re.escape(f"--input {bomb}: not a readable")):  # expat's amplification limit
        list(read_documents(str(bomb)))


UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "marshal", "shelve", "dill", "cloudpickle", "joblib"}
UNSAFE_BUILTINS = {"eval", "exec", "compile", "__import__"}
UNSAFE_LOADERS = {"pickle", "torch", "np", "numpy", "yaml", "marshal", "dill", "joblib"}  # their load()/loads()


def test_data_prep_source_has_no_unsafe_loading():
    """Alongside the behavioural tests above: no unpickling, eval/exec or shell=True anywhere in data_prep."""
    problems = []
    for path in sorted(Path(data_prep.__file__).parent.glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            where = f"{path.name}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.Import):
                problems += [f"{where} imports {a.name}" for a in node.names if a.name.split(".")[0] in UNSAFE_MODULES]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in UNSAFE_MODULES:
                problems.append(f"{where} imports from {node.module}")
            elif isinstance(node, ast.Call):
                func = node.func
                if isinstance(func, ast.Name) and func.id in UNSAFE_BUILTINS:
                    problems.append(f"{where} calls {func.id}()")
                if isinstance(func, ast.Attribute) and func.attr in ("load", "loads") and \
                        isinstance(func.value, ast.Name) and func.value.id in UNSAFE_LOADERS:
                    problems.append(f"{where} calls {func.value.id}.{func.attr}()")
                for keyword in node.keywords:
                    if keyword.arg in ("shell", "allow_pickle") and not (
                            isinstance(keyword.value, ast.Constant) and keyword.value.value is False):
                        problems.append(f"{where} passes {keyword.arg}={ast.unparse(keyword.value)}")
    assert problems == []

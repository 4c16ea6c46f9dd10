"""The settings of a shard build: ``BuildSettings`` (the keys a YAML, flags and ``--set`` overrides give) and
``BuildConfig`` (those settings with the inputs and the vocabulary: everything that determines a build's bytes).

``python -m data_prep.build --config YAML --set KEY=VALUE`` loads the settings through the project's one config
loader (``common.config_loader.load_dataclass``): dataclass defaults, then the YAML, then the flags given, then
the overrides; unknown keys are refused by their dotted name. Every key has a docstring and is listed by
``--help``. An example YAML: ``data_prep/configs/unilm-128.yaml``.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from common.config_loader import load_dataclass
from data_prep.instances import InstanceConfig, MaskingConfig
from data_prep.sources import ROWS_PER_DOCUMENT, TEXT_FIELD, TXT_DOCUMENTS, UNIT_BYTES, ReadOptions

CONFIG_DIR = Path(__file__).parent / "configs"


@dataclass(frozen=True)
class BuildSettings:
    """How a build reads its inputs, makes samples, masks them and cuts shards (the config keys)."""

    instances: InstanceConfig = field(default_factory=InstanceConfig)
    """how documents become samples"""
    masking: MaskingConfig = field(default_factory=MaskingConfig)
    """cloze masking of the masked recipes (unilm, bert); its unset values are resolved for the recipe and the
    length (`MaskingConfig.resolved`)"""
    seed: int = 1
    """seeds every random choice of the build (0 or more)"""
    dupe_factor: int = 1
    """differently-masked copies of every instance (BERT: 10; see docs/shard_format.md)"""
    samples_per_shard: int = 65536
    """upper bound per shard file; shards are balanced, so actual sizes are total / ceil(total / this)"""
    chunk_chars: int = 500_000
    """characters per work unit: documents are processed in chunks of about this many characters (part of the
    output's identity)"""
    text_field: str = TEXT_FIELD
    """the field (column) of JSON, parquet and dataset records that holds the text"""
    rows_per_document: int = ROWS_PER_DOCUMENT
    """with --rows-as-sentences: rows per document (an empty row ends a document early)"""
    txt_documents: str = TXT_DOCUMENTS[0]
    """what a document of a .txt input is: blank-line (blocks between blank lines, BERT's convention), line (one
    document per line) or file (the whole file, its blank lines ending paragraphs)"""
    unit_bytes: int = UNIT_BYTES
    """a .jsonl, .txt, Wikipedia dump (.xml, .xml.bz2) or parquet file larger than this is split into byte ranges
    (of lines, of a .txt's documents, of a dump's bzip2 streams or blocks, of row groups) that different builders
    read"""

    def __post_init__(self) -> None:
        object.__setattr__(self, "masking", self.masking.resolved(self.instances.recipe, self.instances.max_seq_len))
        if self.seed < 0:
            raise ValueError(f"--seed {self.seed} must be 0 or more (it seeds numpy's random generators)")
        ReadOptions(self.text_field, False, self.rows_per_document, self.txt_documents)  # validates them
        if self.dupe_factor < 1:
            raise ValueError(f"--dupe-factor {self.dupe_factor} must be at least 1")
        if self.dupe_factor > 1 and not self.instances.masked:
            raise ValueError("--dupe-factor applies to masked recipes; gpt has no masking, copies would be identical")
        if self.samples_per_shard < 1 or self.chunk_chars < 1 or self.unit_bytes < 1:
            raise ValueError("--samples-per-shard, --chunk-chars and unit_bytes must be positive")


@dataclass(frozen=True, kw_only=True)
class BuildConfig(BuildSettings):
    """Everything that determines the bytes of a build (recorded in the manifest): the settings, the inputs and
    the vocabulary they are encoded with."""

    inputs: tuple[str, ...]
    vocab_path: str
    vocab_sha256: str
    uncased: bool = False
    """the casing the vocabulary encodes with (``data_prep.vocab.resolve_casing``)"""
    sentence_inputs: tuple[str, ...] = ()
    """inputs whose rows are sentences: consecutive rows form documents of ``rows_per_document`` rows"""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.inputs:
            raise ValueError("no --input given")
        strays = [s for s in self.sentence_inputs if s not in self.inputs]
        if strays:
            raise ValueError(f"--rows-as-sentences {' '.join(strays)}: not among the --input sources; name inputs "
                             "exactly as given to --input, or give the flag alone to apply it to every input")
        if self.sentence_inputs and self.txt_documents != TXT_DOCUMENTS[0]:
            raise ValueError(f"--txt-documents {self.txt_documents} and --rows-as-sentences both say what a document "
                             "of a .txt input is; give one of them")

    @classmethod
    def of(cls, settings: BuildSettings, inputs: Sequence[str], vocab_path: str = "", vocab_sha256: str = "",
           uncased: bool = False, sentence_inputs: Sequence[str] = ()) -> BuildConfig:
        """``settings`` for these inputs and this vocabulary."""
        return cls(**{f.name: getattr(settings, f.name) for f in dataclasses.fields(BuildSettings)},
                   inputs=tuple(inputs), vocab_path=vocab_path, vocab_sha256=vocab_sha256, uncased=uncased,
                   sentence_inputs=tuple(sentence_inputs))

    def read_options(self, spec: str) -> ReadOptions:
        return ReadOptions(self.text_field, spec in self.sentence_inputs, self.rows_per_document, self.txt_documents)

    def to_json(self) -> dict:
        return json.loads(json.dumps(asdict(self)))

    @property
    def fingerprint(self) -> str:
        """Identity of the output; the vocab counts by content, so builders may keep it at different paths."""
        identity = {k: v for k, v in self.to_json().items() if k != "vocab_path"}
        return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()

    @staticmethod
    def from_json(payload: dict) -> BuildConfig:
        payload = dict(payload)
        masking = dict(payload.pop("masking"))
        masking["span_length_probs"] = tuple(masking["span_length_probs"])
        return BuildConfig(inputs=tuple(payload.pop("inputs")), instances=InstanceConfig(**payload.pop("instances")),
                           sentence_inputs=tuple(payload.pop("sentence_inputs")), masking=MaskingConfig(**masking),
                           **payload)


def load_settings(path: str | Path | None, overrides: Sequence[str] = ()) -> BuildSettings:
    """The settings of a YAML file (``path``, optional) with dotted ``key=value`` overrides applied in order."""
    return load_dataclass(BuildSettings, path, overrides)

"""`elastic data prepare`: text or JSONL files -> token shards that a `data.kind: tokens` job reads.

    elastic data prepare books/ --out tokens/                                  # byte-level tokens, .bin shards
    elastic data prepare 'raw/*.jsonl' --out s3://bucket/tokens --tokenizer tokenizer.json --eos '<|endoftext|>'
    elastic data prepare raw/ --out tokens/ --format parquet --tokenizer tokenizer.json

Inputs are files, directories (searched recursively) or globs, local or any
fsspec URI, read in order (each argument's files sorted by path): `.jsonl`
holds one document per line (its --text-field), a `.txt` or `.md` file is one
document (one per line with --line-docs). Each document is tokenized with a
Hugging Face `tokenizers` file (`pip install -e '.[hf]'`) followed by its
--eos token, or without one as UTF-8 bytes (ids 0-255) followed by 256 (a
vocabulary of 257).

`--format bin` (the default) writes flat shards `tokens-00000.bin` of uint16
(uint32 for vocabularies over 65536), documents and their EOS back to back;
`--format parquet` writes `tokens-00000.parquet`, one row per document
(column `input_ids`) in row groups of about --row-group-tokens, with the EOS
left to the job's `data.eos_token`. Either way the job reads the same token
stream. The command ends by printing the job YAML's `data` section.
"""

from __future__ import annotations

import argparse
import json
from typing import Iterator

import numpy as np

from elastic.errors import UsageError

TEXT_SUFFIXES = (".jsonl", ".txt", ".md")
BYTE_EOS = 256
BATCH_DOCS = 512
"""Documents tokenized together (the tokenizers library encodes a batch on all cores)."""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("data", help="prepare training data: text or JSONL -> token shards",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    prep = sub.add_parser("prepare", help="tokenize text or JSONL files into .bin or Parquet token shards",
                          description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    prep.add_argument("inputs", nargs="+", metavar="INPUT", help="text/JSONL files, directories or globs (local or fsspec URIs)")
    prep.add_argument("--out", required=True, help="directory (local or fsspec URI) for the shards; must be empty or new")
    prep.add_argument("--tokenizer", help="a Hugging Face tokenizer.json (local or fsspec); default: byte-level tokens")
    prep.add_argument("--eos", help="with --tokenizer: the token appended after each document (e.g. '<|endoftext|>')")
    prep.add_argument("--format", choices=("bin", "parquet"), default="bin", help="shard format (default bin)")
    prep.add_argument("--text-field", default="text", help="the JSONL field holding a document's text (default text)")
    prep.add_argument("--line-docs", action="store_true", help="each non-empty line of a .txt/.md file is a document")
    prep.add_argument("--shard-tokens", type=int, default=1 << 28, help="tokens per shard at most (default 2^28)")
    prep.add_argument("--row-group-tokens", type=int, default=1 << 20, help="Parquet: tokens per row group, about (default 2^20)")
    prep.set_defaults(func=prepare)


# -- reading documents -----------------------------------------------------------------------------------------------
def _inputs(patterns: list[str]) -> list[tuple[object, str, int]]:
    """(filesystem, path, size) of every input file, in order."""
    import fsspec

    from elastic.tokens import list_files

    out = []
    for pattern in patterns:
        root, files = list_files(pattern, TEXT_SUFFIXES, "input")
        fs, root_path = fsspec.core.url_to_fs(root)
        out += [(fs, f"{root_path.rstrip('/')}/{rel}", size) for rel, size in files]
    return out


def _documents(inputs, text_field: str, line_docs: bool) -> Iterator[tuple[str, int]]:
    """(text, input bytes it came from) of each document, in order."""
    for fs, path, size in inputs:
        with fs.open(path, "rb") as f:
            if path.endswith(".jsonl"):
                for number, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        text = json.loads(line).get(text_field)
                    except (ValueError, AttributeError):
                        raise UsageError(f"{path} line {number}: not a JSON object") from None
                    if not isinstance(text, str):
                        raise UsageError(f"{path} line {number}: no string field {text_field!r} (--text-field)")
                    yield text, len(line)
            elif line_docs:
                for line in f:
                    if line.strip():
                        yield line.decode("utf-8", errors="replace").rstrip("\r\n"), len(line)
            else:
                yield f.read().decode("utf-8", errors="replace"), size


class _Encoder:
    """Text -> token ids, each document followed by the EOS (if any)."""

    def __init__(self, tokenizer_path: str | None, eos: str | None):
        if tokenizer_path is None:
            if eos is not None:
                raise UsageError("--eos names a token of --tokenizer; byte-level tokens always end a document with 256")
            self.tokenizer, self.eos, self.vocab_size = None, BYTE_EOS, BYTE_EOS + 1
            return
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise UsageError("--tokenizer needs the Hugging Face tokenizers package: pip install -e '.[hf]'") from None
        import fsspec

        try:
            with fsspec.open(tokenizer_path, "r", encoding="utf-8") as f:
                self.tokenizer = Tokenizer.from_str(f.read())
        except FileNotFoundError:
            raise UsageError(f"--tokenizer {tokenizer_path}: no such file") from None
        except Exception as exc:  # noqa: BLE001 - not a tokenizer file: say so on one line
            raise UsageError(f"--tokenizer {tokenizer_path}: not a tokenizers JSON file ({type(exc).__name__}: {exc})") from None
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos = None
        if eos is not None:
            self.eos = self.tokenizer.token_to_id(eos)
            if self.eos is None:
                raise UsageError(f"--eos {eos!r} is not a token of {tokenizer_path}")

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        if self.tokenizer is None:
            ids = [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.int64) for t in texts]
        else:
            ids = [np.asarray(e.ids, dtype=np.int64) for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]
        return ids


# -- writing shards ------------------------------------------------------------------------------------------------------
class _ShardWriter:
    """Shards `tokens-NNNNN<suffix>` under one directory: a new shard when the next write would pass `shard_tokens`."""

    suffix = ""

    def __init__(self, fs, root: str, dtype, shard_tokens: int):
        self.fs, self.root, self.dtype, self.shard_tokens = fs, root, dtype, shard_tokens
        self.count = 0
        self.in_shard = 0
        self.file = None

    def _file_for(self, tokens: int):
        if self.file is not None and self.in_shard and self.in_shard + tokens > self.shard_tokens:
            self.close()
        if self.file is None:
            self.file = self.fs.open(f"{self.root}/tokens-{self.count:05d}{self.suffix}", "wb")
            self.count += 1
            self.in_shard = 0
        self.in_shard += tokens
        return self.file

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None

    def finish(self) -> None:
        """Write what is buffered and close the last shard."""
        self.close()


class BinWriter(_ShardWriter):
    """Documents and their EOS back to back."""

    suffix = ".bin"

    def __init__(self, fs, root: str, dtype, shard_tokens: int, eos: int | None):
        super().__init__(fs, root, dtype, shard_tokens)
        self.eos = eos

    def add(self, docs: list[np.ndarray]) -> None:
        for doc in docs:
            tokens = doc if self.eos is None else np.append(doc, self.eos)
            self._file_for(len(tokens)).write(tokens.astype(self.dtype).tobytes())


class ParquetWriter(_ShardWriter):
    """One row per document in column `input_ids`, row groups of about `row_group_tokens` (the unit a job decodes)."""

    suffix = ".parquet"

    def __init__(self, fs, root: str, dtype, shard_tokens: int, row_group_tokens: int):
        super().__init__(fs, root, dtype, shard_tokens)
        self.row_group_tokens = row_group_tokens
        self.rows: list[np.ndarray] = []
        self.buffered = 0
        self.writer = None

    def add(self, docs: list[np.ndarray]) -> None:
        for doc in docs:
            self.rows.append(doc)
            self.buffered += len(doc)
            if self.buffered >= self.row_group_tokens:
                self._write_group()

    def _write_group(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        file = self._file_for(self.buffered)
        if self.writer is None:
            value_type = pa.uint16() if self.dtype == np.uint16 else pa.uint32()
            self.writer = pq.ParquetWriter(file, pa.schema([("input_ids", pa.list_(value_type))]))
        offsets = np.zeros(len(self.rows) + 1, dtype=np.int32)
        np.cumsum([len(r) for r in self.rows], out=offsets[1:])
        values = pa.array(np.concatenate(self.rows).astype(self.dtype))
        self.writer.write_table(pa.table({"input_ids": pa.ListArray.from_arrays(pa.array(offsets), values)}))
        self.rows, self.buffered = [], 0

    def finish(self) -> None:
        if self.rows:
            self._write_group()
        self.close()

    def close(self) -> None:
        if self.writer is not None:  # the footer goes before the shard closes
            self.writer.close()
            self.writer = None
        super().close()


# -- the command ---------------------------------------------------------------------------------------------------------
def _tokenize(inputs, args: argparse.Namespace, encoder: _Encoder, writer) -> tuple[int, int]:
    """Tokenize every document into `writer`, with a progress bar over the input bytes on a terminal; (documents, tokens)."""
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    console = Console(stderr=True)
    columns = (TextColumn("tokenizing"), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn())
    documents = tokens = 0
    total = sum(size for _, _, size in inputs)
    with Progress(*columns, console=console, disable=not console.is_terminal) as progress:
        task = progress.add_task("tokenizing", total=total)
        batch, done_bytes = [], 0
        for text, nbytes in _documents(inputs, args.text_field, args.line_docs):
            batch.append(text)
            done_bytes += nbytes
            if len(batch) == BATCH_DOCS:
                docs = encoder.encode(batch)
                writer.add(docs)
                documents, tokens = documents + len(docs), tokens + sum(map(len, docs))
                progress.update(task, completed=done_bytes)
                batch = []
        docs = encoder.encode(batch)
        writer.add(docs)
        documents, tokens = documents + len(docs), tokens + sum(map(len, docs))
        progress.update(task, completed=total)  # blank lines included
    writer.finish()
    return documents, tokens + (documents if encoder.eos is not None else 0)


def prepare(args: argparse.Namespace) -> int:
    import fsspec

    if args.shard_tokens < 1 or args.row_group_tokens < 1:
        raise UsageError("--shard-tokens and --row-group-tokens must be positive")
    inputs = _inputs(args.inputs)
    encoder = _Encoder(args.tokenizer, args.eos)
    fs, root = fsspec.core.url_to_fs(args.out)
    root = root.rstrip("/")
    if fs.exists(root) and fs.ls(root):
        raise UsageError(f"--out {args.out}: not empty; shards must go to an empty or new directory")
    fs.makedirs(root, exist_ok=True)
    dtype = np.uint16 if encoder.vocab_size <= 1 << 16 else np.uint32
    if args.format == "bin":
        writer = BinWriter(fs, root, dtype, args.shard_tokens, encoder.eos)
    else:
        writer = ParquetWriter(fs, root, dtype, args.shard_tokens, args.row_group_tokens)
    try:
        documents, tokens = _tokenize(inputs, args, encoder, writer)
    except BaseException:
        writer.close()
        fs.rm(root, recursive=True)  # no half-written corpus: a rerun starts clean
        raise
    out = args.out.rstrip("/")
    data = {"kind": "tokens", "path": out, **({"dtype": np.dtype(dtype).name} if args.format == "bin" else {})}
    if args.format == "parquet" and encoder.eos is not None:
        data["eos_token"] = encoder.eos
    print(f"{documents} documents, {tokens} tokens in {writer.count} {args.format} shards under {out}")
    print(f"# for the job YAML (model.vocab_size must be at least {encoder.vocab_size}):")
    print("data: {" + ", ".join(f"{k}: {v}" for k, v in data.items()) + "}")
    return 0

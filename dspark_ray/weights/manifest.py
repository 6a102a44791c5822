"""Checkpoint identity: a manifest beside the weights, and the digest HELLO compares. A hash per tensor's raw bytes,
then one over the sorted list: tensors hash in parallel and a check names the one that changed. Nothing
machine-specific (paths, shard layout) is hashed, so the same weights give the same digest however written.
"""
from __future__ import annotations

import hashlib
import json
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping

import torch

FORMAT = "dspark-manifest/1"
MANIFEST_NAME = "dspark-manifest.json"
_READ_CHUNK = 64 << 20


class ManifestError(ValueError):
    """The checkpoint does not match its manifest."""


# For synth.py's own writer: `safetensors.torch.save_file` 0.8 cannot write F8_E8M0.
DTYPE_TAGS = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.float8_e8m0fnu: "F8_E8M0",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL"}
TAG_DTYPES = {v: k for k, v in DTYPE_TAGS.items()}

@dataclass(frozen=True)
class StoredTensor:
    name: str
    path: Path
    dtype: str                  # safetensors tag
    shape: tuple[int, ...]
    begin: int                  # absolute byte offsets in the file
    end: int


def scan_safetensors(path: str | Path) -> list[StoredTensor]:
    path = Path(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ManifestError(f"{path}: shorter than a safetensors header")
        (n,) = struct.unpack("<Q", raw)
        header = json.loads(f.read(n))
    base = 8 + n
    return [StoredTensor(name, path, e["dtype"], tuple(e["shape"]), base + e["data_offsets"][0],
                         base + e["data_offsets"][1])
            for name, e in header.items() if name != "__metadata__"]


def hash_stored(t: StoredTensor) -> str:
    h = hashlib.sha256()
    with open(t.path, "rb") as f:
        f.seek(t.begin)
        left = t.end - t.begin
        while left:
            buf = f.read(min(left, _READ_CHUNK))
            if not buf:
                raise ManifestError(f"tensor {t.name}: file {t.path.name} ends {left} bytes early")
            h.update(buf)
            left -= len(buf)
    return h.hexdigest()


def records_from_files(tensors: Iterable[StoredTensor], workers: int = 8) -> dict[str, dict]:
    """name -> {shape, dtype, sha256}, hashed in parallel (hashlib drops the GIL)."""
    ts = list(tensors)
    with ThreadPoolExecutor(workers) as ex:
        shas = list(ex.map(hash_stored, ts))
    return {t.name: {"shape": list(t.shape), "dtype": t.dtype, "sha256": s} for t, s in zip(ts, shas)}


def compute_manifest(config_digest: str, records: Mapping[str, Mapping]) -> dict:
    """records: name -> {shape, dtype, sha256 (hex of the tensor's raw bytes)}."""
    content = hashlib.sha256()
    for name in sorted(records):
        content.update(f"{name}\0{records[name]['sha256']}\n".encode())
    content_sha = content.hexdigest()
    layout = {name: [list(records[name]["shape"]), records[name]["dtype"]] for name in sorted(records)}
    ident = json.dumps({"config_digest": config_digest, "tensors": layout, "content_sha256": content_sha},
                       sort_keys=True, separators=(",", ":"))
    return {
        "format": FORMAT,
        "config_digest": config_digest,
        "tensors": {name: {"shape": list(records[name]["shape"]), "dtype": records[name]["dtype"],
                           "sha256": records[name]["sha256"]} for name in sorted(records)},
        "content_sha256": content_sha,
        "identity_digest": hashlib.sha256(ident.encode()).hexdigest(),
    }


def write_manifest(ckpt_dir: str | Path, manifest: Mapping) -> Path:
    p = Path(ckpt_dir) / MANIFEST_NAME
    tmp = p.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    tmp.replace(p)              # atomic: a reader never sees half a manifest
    return p


def read_manifest(ckpt_dir: str | Path) -> dict | None:
    """The manifest beside a checkpoint, or None; refuses an unknown format."""
    p = Path(ckpt_dir) / MANIFEST_NAME
    if not p.exists():
        return None
    m = json.loads(p.read_text())
    if m.get("format") != FORMAT:
        raise ManifestError(f"{p}: format {m.get('format')!r} is not {FORMAT!r}")
    return m


def check_layout(manifest: Mapping, stored: Mapping[str, StoredTensor],
                 keep: Callable[[str], bool] = lambda name: True) -> None:
    """Names, shapes and dtypes of the stored tensors `keep` selects equal the manifest's, both ways."""
    listed = manifest["tensors"]
    for name in sorted(listed):
        if name not in stored:
            raise ManifestError(f"tensor {name}: listed in {MANIFEST_NAME} but missing from the checkpoint files")
        want, t = listed[name], stored[name]
        if list(t.shape) != list(want["shape"]):
            raise ManifestError(f"tensor {name}: shape {list(t.shape)} in the files, manifest says {want['shape']}")
        if t.dtype != want["dtype"]:
            raise ManifestError(f"tensor {name}: dtype {t.dtype} in the files, manifest says {want['dtype']}")
    extra = sorted(n for n in stored if keep(n) and n not in listed)
    if extra:
        raise ManifestError(f"tensor {extra[0]}: in the checkpoint files but not listed in {MANIFEST_NAME}"
                            + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))


def check_content(manifest: Mapping, stored: Mapping[str, StoredTensor]) -> None:
    """Every listed tensor's bytes hash to the manifest's sha256, and the manifest's own sums add up."""
    got = records_from_files(stored[n] for n in manifest["tensors"])
    for name in sorted(got):
        if got[name]["sha256"] != manifest["tensors"][name]["sha256"]:
            raise ManifestError(f"tensor {name}: content sha256 {got[name]['sha256'][:16]}... differs from the "
                                f"manifest's {manifest['tensors'][name]['sha256'][:16]}... (bytes changed)")
    again = compute_manifest(manifest["config_digest"], got)
    for key in ("content_sha256", "identity_digest"):
        if again[key] != manifest[key]:
            raise ManifestError(f"{MANIFEST_NAME}: {key} {manifest[key][:16]}... does not follow from its tensors "
                                f"({again[key][:16]}...): the manifest was edited")

"""Paths on a local disk and in a bucket alike (gs://, or any fsspec URL): the one thing a
bucket cannot do as a file does, appending, and the filesystem behind a path.

Buckets are reached through gcsfs (files) and tensorstore (orbax checkpoints), which read
the standard variables: STORAGE_EMULATOR_HOST and TENSORSTORE_GCS_HTTP_URL point both
at an emulator, GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false skips gcsfs's gRPC probe.
"""

from __future__ import annotations

import os


def is_remote(path: str) -> bool:
  return "://" in str(path)


def filesystem(path: str):
  """(fsspec filesystem, path within it)."""
  from fsspec.core import url_to_fs
  return url_to_fs(os.path.expanduser(str(path)))


def append_text(path: str, text: str) -> None:
  """Adds text at the end of a file. In a bucket, where objects are written whole, the new
  part is written as its own object and composed onto the end (one request, whatever the
  file's size), then removed."""
  if not is_remote(path):
    with open(path, "a", encoding="utf-8") as f:
      f.write(text)
    return
  fs, p = filesystem(path)
  if not fs.exists(p):
    fs.pipe(p, text.encode("utf-8"))
    return
  part = f"{p}.part{os.getpid()}"
  fs.pipe(part, text.encode("utf-8"))
  fs.merge(p, [p, part])
  fs.rm(part)

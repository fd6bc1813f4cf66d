"""Files of the offline job: input discovery, the output directory, per-file markers and atomic writes.

Layout of an output directory::

    OUT/_job.json                 what the outputs depend on (checkpoint hash, questions, columns...)
    OUT/<rel>.parquet             one output file per input file, rows in input order
    OUT/_progress/<rel>.json      written (atomically) after its output file is in place: done
    OUT/_summary.json             the last run's summary
    OUT/.lock                     held (flock) while a run is active

`<rel>` is the input file's path relative to the common directory of all inputs. A file counts as done
only when its marker exists, its output exists, and the input's size and mtime still match the marker.
"""

from __future__ import annotations

import fcntl
import fnmatch
import glob
import json
import logging
import os
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

log = logging.getLogger(__name__)

JOB_FILE, SUMMARY_FILE, PROGRESS_DIR, LOCK_FILE = "_job.json", "_summary.json", "_progress", ".lock"
TMP_TAG = ".tmp-"


class ConfigError(ValueError):
    """A problem with the job's arguments or inputs, found before any row is scored (exit code 2)."""


@dataclass
class InputFile:
    """One input Parquet file: where it is, its row count and schema, and where its output goes."""

    uri: str             # as given / discovered (what the user sees)
    path: str            # path on `fs` (what Ray reports in its `path` column)
    rel: str             # output path relative to OUT
    size: int
    mtime: float
    num_rows: int = 0
    schema: pa.Schema | None = None


def _is_uri(s: str) -> bool:
    return "://" in s


def _has_magic(s: str) -> bool:
    return any(c in s for c in "*?[")


def _list_parquet(fs: pafs.FileSystem, base: str) -> list[pafs.FileInfo]:
    infos = fs.get_file_info(pafs.FileSelector(base, recursive=True))
    return [i for i in infos if i.type == pafs.FileType.File and i.path.endswith(".parquet")
            and not any(part.startswith(("_", ".")) for part in os.path.relpath(i.path, base).split("/"))]


def discover(inputs: list[str], exclude: str | None = None) -> tuple[pafs.FileSystem, list[InputFile]]:
    """The Parquet files named by paths, directories (recursive) or globs, sorted, on one filesystem.

    Local files under `exclude` (the output directory, which may sit inside an input directory) are left out.
    """
    found: dict[str, tuple[str, pafs.FileInfo]] = {}
    filesystem, fs_type = None, None
    for raw in inputs:
        spec = raw if _is_uri(raw) else os.path.abspath(os.path.expanduser(raw))
        if _has_magic(spec):
            if _is_uri(spec):
                prefix = spec.split("*")[0].split("?")[0].split("[")[0].rsplit("/", 1)[0]
                fs, base = pafs.FileSystem.from_uri(prefix)
                pattern = base + spec[len(prefix):]
                infos = [i for i in _list_parquet(fs, base) if fnmatch.fnmatch(i.path, pattern)]
            else:
                fs = pafs.LocalFileSystem()
                paths = sorted(p for p in glob.glob(spec, recursive=True) if os.path.isfile(p))
                infos = fs.get_file_info(paths) if paths else []
        else:
            fs, path = pafs.FileSystem.from_uri(spec)
            info = fs.get_file_info(path)
            if info.type == pafs.FileType.NotFound:
                raise ConfigError("input %r does not exist" % raw)
            infos = _list_parquet(fs, path) if info.type == pafs.FileType.Directory else [info]
        if not infos:
            raise ConfigError("input %r matches no Parquet files" % raw)
        if fs_type is None:
            filesystem, fs_type = fs, fs.type_name
        elif fs.type_name != fs_type:
            raise ConfigError("all inputs must be on one filesystem; %r is on %s, not %s"
                              % (raw, fs.type_name, fs_type))
        for info in infos:
            uri = info.path if fs.type_name == "local" else "%s://%s" % (spec.split("://")[0], info.path)
            found.setdefault(info.path, (uri, info))
    if exclude and fs_type == "local":
        found = {p: v for p, v in found.items() if not p.startswith(exclude.rstrip(os.sep) + os.sep)}
        if not found:
            raise ConfigError("every input file is inside the output directory %s" % exclude)
    paths = sorted(found)
    root = os.path.commonpath([os.path.dirname(p) for p in paths]) if len(paths) > 1 else os.path.dirname(paths[0])
    files = []
    for p in paths:
        uri, info = found[p]
        mtime = info.mtime.timestamp() if info.mtime is not None else 0.0
        files.append(InputFile(uri, p, os.path.relpath(p, root), int(info.size or 0), mtime))
    return filesystem, files


def read_footers(fs: pafs.FileSystem, files: list[InputFile], threads: int = 16) -> dict[str, str]:
    """Fill in each file's row count and Arrow schema from its Parquet footer (no data is read).

    Returns the reason for each file (by path) whose footer cannot be read: missing, truncated, not Parquet.
    """
    bad: dict[str, str] = {}

    def one(f: InputFile) -> None:
        try:
            with fs.open_input_file(f.path) as fh:
                md = pq.ParquetFile(fh).metadata
                f.num_rows, f.schema = md.num_rows, md.schema.to_arrow_schema()
        except (OSError, pa.ArrowInvalid) as e:
            bad[f.path] = "cannot read the Parquet footer of %s: %s" % (f.uri, str(e).splitlines()[0] if str(e)
                                                                          else type(e).__name__)

    with ThreadPoolExecutor(max(1, min(threads, len(files)))) as ex:
        list(ex.map(one, files))
    return bad


def is_state_type(t: pa.DataType) -> bool:
    """Whether a column of Arrow type `t` can hold states: text, bytes, struct, list or map."""
    return any(f(t) for f in (pa.types.is_string, pa.types.is_large_string, pa.types.is_binary,
                              pa.types.is_large_binary, pa.types.is_struct, pa.types.is_list,
                              pa.types.is_large_list, pa.types.is_map))


def check_columns(files: list[InputFile], state_column: str, carry: list[str]) -> dict[str, str]:
    """The reason for each file (by path) that lacks a column, or holds it in a type the job cannot read.

    The state column must be text, bytes, struct, list or map; every column read must have one type across the
    inputs (Ray Data reads them as one dataset), the type most inputs have.
    """
    bad: dict[str, str] = {}
    for f in files:
        names = set(f.schema.names)
        missing = [c for c in [state_column] + carry if c not in names]
        if missing:
            bad[f.path] = "column %r is not in %s (it has %s)" % (missing[0], f.uri, sorted(names))
        elif not is_state_type(f.schema.field(state_column).type):
            bad[f.path] = ("column %r of %s is %s; the state column must be string, binary, struct, list or map"
                           % (state_column, f.uri, f.schema.field(state_column).type))
    for c in [state_column] + carry:
        kinds = Counter(str(f.schema.field(c).type) for f in files if f.path not in bad)
        if len(kinds) < 2:
            continue
        usual = kinds.most_common(1)[0][0]
        for f in files:
            t = str(f.schema.field(c).type) if f.path not in bad else usual
            if t != usual:
                bad[f.path] = "column %r of %s is %s, but %s in the other inputs" % (c, f.uri, t, usual)
    return bad


# -- atomic writes ------------------------------------------------------------------------------
def _fsync_dir(d: str) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:  # pragma: no cover
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - some filesystems refuse
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: str, data: bytes) -> None:
    """Write `path` so readers see the old file or the whole new one, never a part."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = "%s%s%d" % (path, TMP_TAG, os.getpid())
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path))


def atomic_write_json(path: str, obj: Any) -> None:
    """`atomic_write_bytes` of pretty JSON."""
    atomic_write_bytes(path, (json.dumps(obj, indent=1, sort_keys=True, default=str) + "\n").encode())


def atomic_write_parquet(path: str, table: pa.Table) -> None:
    """Write a Parquet file atomically (temporary file in the same directory, fsync, rename)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = "%s%s%d" % (path, TMP_TAG, os.getpid())
    pq.write_table(table, tmp)
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path))


# -- the output directory -----------------------------------------------------------------------
class OutputDir:
    """An output directory: lock, job fingerprint, per-file markers."""

    def __init__(self, root: str):
        self.root = os.path.abspath(os.path.expanduser(root))
        self._lock_fh = None

    def path(self, *parts: str) -> str:
        """A path under the output directory."""
        return os.path.join(self.root, *parts)

    def output_path(self, f: InputFile) -> str:
        """Where the output of input `f` goes."""
        return self.path(f.rel)

    def marker_path(self, f: InputFile) -> str:
        """Where the done-marker of input `f` goes."""
        return self.path(PROGRESS_DIR, f.rel + ".json")

    def lock(self) -> None:
        """Take the directory's lock (released when the process exits); ConfigError if another run holds it."""
        if os.path.exists(self.root) and not os.path.isdir(self.root):
            raise ConfigError("--output %s is a file; name a directory" % self.root)
        try:
            os.makedirs(self.root, exist_ok=True)
            self._lock_fh = open(self.path(LOCK_FILE), "a+")
        except OSError as e:
            raise ConfigError("--output %s cannot be written: %s" % (self.root, e.strerror or e)) from None
        try:
            fcntl.flock(self._lock_fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_fh.seek(0)
            holder = self._lock_fh.read().strip() or "?"
            self._lock_fh.close()
            self._lock_fh = None
            raise ConfigError("another run (pid %s) is writing to %s (it holds %s)"
                              % (holder, self.root, LOCK_FILE)) from None
        self._lock_fh.seek(0)
        self._lock_fh.truncate()
        self._lock_fh.write("%d\n" % os.getpid())
        self._lock_fh.flush()

    def unlock(self) -> None:
        """Release the lock."""
        if self._lock_fh is not None:
            fcntl.flock(self._lock_fh, fcntl.LOCK_UN)
            self._lock_fh.close()
            self._lock_fh = None

    def check_job(self, fingerprint: dict, overwrite: bool) -> bool:
        """Record the job fingerprint; True when earlier outputs can be reused.

        A directory holding outputs of a different job (other questions, checkpoint, columns...) is
        refused unless `overwrite`, which removes them.
        """
        f = self.path(JOB_FILE)
        old = None
        if os.path.exists(f):
            with open(f, encoding="utf-8") as fh:
                try:
                    old = json.load(fh)
                except json.JSONDecodeError:
                    old = {}
        if old is not None and old != fingerprint and not overwrite:
            diff = sorted(k for k in set(old) | set(fingerprint) if old.get(k) != fingerprint.get(k))
            raise ConfigError("%s holds outputs of a different job (differs in %s); use another --output "
                              "or pass --overwrite to replace them" % (self.root, ", ".join(diff)))
        if overwrite and old is not None:
            self.clear()
        atomic_write_json(f, fingerprint)
        return old is not None and not overwrite

    def discard_if_unused(self, created: bool, had_job_file: bool) -> None:
        """After a failed run that completed no file: remove the job file it wrote and, when the run `created`
        the directory, the lock and the directory, so the next run starts as if this one never happened."""
        if not had_job_file and os.path.exists(self.path(JOB_FILE)):
            os.remove(self.path(JOB_FILE))
        if created and set(os.listdir(self.root)) <= {LOCK_FILE}:
            self.unlock()
            if os.path.exists(self.path(LOCK_FILE)):
                os.remove(self.path(LOCK_FILE))
            os.rmdir(self.root)

    def clear(self) -> None:
        """Remove earlier outputs, markers and summary (keeps the lock)."""
        import shutil

        for name in os.listdir(self.root):
            if name == LOCK_FILE:
                continue
            p = self.path(name)
            if os.path.isdir(p):
                shutil.rmtree(p)
            else:
                os.remove(p)

    def is_done(self, f: InputFile) -> bool:
        """Whether input `f` has a valid marker, its output file, and has not changed since."""
        m = self.marker_path(f)
        if not (os.path.exists(m) and os.path.exists(self.output_path(f))):
            return False
        try:
            with open(m, encoding="utf-8") as fh:
                rec = json.load(fh)
        except (OSError, json.JSONDecodeError):
            return False
        same = rec.get("input_size") == f.size and abs(float(rec.get("input_mtime", -1)) - f.mtime) < 1e-3
        if not same:
            log.warning("%s changed since it was scored; scoring it again", f.uri)
        return same

    def read_marker(self, f: InputFile) -> dict:
        """The marker record of a done input."""
        with open(self.marker_path(f), encoding="utf-8") as fh:
            return json.load(fh)

    def clean_temporaries(self) -> int:
        """Remove temporary files a killed run left behind; returns how many."""
        n = 0
        for dirpath, _, names in os.walk(self.root):
            for name in names:
                if TMP_TAG in name:
                    os.remove(os.path.join(dirpath, name))
                    n += 1
        return n

    def finish(self, f: InputFile, table: pa.Table, record: dict) -> None:
        """Write input `f`'s output file, then its marker (both atomic, in that order)."""
        atomic_write_parquet(self.output_path(f), table)
        rec = dict(record, input=f.uri, output=self.output_path(f), input_size=f.size, input_mtime=f.mtime,
                   finished_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
        atomic_write_json(self.marker_path(f), rec)

"""Where a store's bytes live: a local directory or an fsspec object store, behind one small interface.

Every path is relative to the store's root and ``/``-separated.  What each backend guarantees (and what the
protocol of spec/store.md §7 relies on):

* **Atomic objects.** ``write`` publishes all of an object or nothing (local: a temporary file in the same
  directory, fsync, rename or hard link, fsync of the directory; object stores: one PUT).  ``create=True``
  publishes only if no object has the name (local: a hard link that fails if the name exists; S3: a PUT with
  ``If-None-Match: *``), and says whether it did.
* **Bounded reads of plain objects only.** ``read(path, limit)`` never returns more than ``limit`` bytes: an
  object over it raises :class:`~kvcodec.errors.LimitExceeded`.  Locally every path component is opened
  relative to its directory with ``O_NOFOLLOW`` (``openat``), so a symbolic link, a FIFO or a device is never
  followed, read, listed as an object or deleted: it raises :class:`~kvcodec.errors.UnsafeObject` (reads) or
  is listed as ``"other"`` (listings).  Object stores hold plain objects only.
* **One clock.** Modification times (``mtime``) and :meth:`clock` come from the store itself (the file
  system's timestamps; the object store's ``LastModified``), never from this process's clock: ages compare
  the store's times with each other.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat as stat_
import time
from dataclasses import dataclass

from ..atomic import held_elsewhere, hold
from ..errors import ConfigError, LimitExceeded, UnsafeObject, warn
from .keys import TEMP_SUFFIX


@dataclass(frozen=True)
class Item:
    """One name in a listing: ``kind`` is ``"file"``, ``"dir"`` or ``"other"`` (a link, a FIFO ...: never
    followed); ``size`` and ``mtime`` (store clock, seconds) for files; ``etag`` where the store has one."""
    name: str
    kind: str
    size: int = 0
    mtime: float = 0.0
    etag: str | None = None


def _timestamp(t) -> float:
    if hasattr(t, "timestamp"):
        return float(t.timestamp())
    try:
        return float(t)
    except (TypeError, ValueError):
        return 0.0


def _split(rel: str) -> tuple[list[str], str]:
    parts = [p for p in rel.split("/") if p]
    if not parts or any(p in (".", "..") for p in parts):
        raise ConfigError(f"not a store path: {rel!r}")
    return parts[:-1], parts[-1]


_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_READ_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
_NEW_FLAGS = (os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
_UNSAFE = {errno.ELOOP, errno.ENOTDIR, errno.EISDIR, errno.ENXIO, errno.EMLINK}


class LocalBackend:
    """A directory on a local (or network) file system, read and written without following any link below
    its root (the root itself is resolved once: it is the user's choice)."""

    local = True

    def __init__(self, root: str):
        self.root = os.path.realpath(os.path.expanduser(root))

    def describe(self) -> str:
        return self.root

    def root_exists(self) -> bool:
        return os.path.isdir(self.root)

    # -- directories, opened relative to each other ------------------------------------------------------------
    @contextlib.contextmanager
    def _dir(self, parts: list[str], create: bool = False):
        """A file descriptor of the directory ``root/parts...`` (None when absent and not ``create``d)."""
        if create:
            os.makedirs(self.root, exist_ok=True)
        try:
            fd = os.open(self.root, _DIR_FLAGS & ~getattr(os, "O_NOFOLLOW", 0))
        except FileNotFoundError:
            yield None
            return
        try:
            for i, part in enumerate(parts):
                try:
                    nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        os.close(fd)
                        fd = None
                        break
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(part, 0o777, dir_fd=fd)
                    nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except OSError as e:
                    if e.errno in _UNSAFE:
                        raise UnsafeObject(f"{'/'.join(parts[:i + 1])} is not a plain directory (a link, a file or "
                                           "a special file where the store keeps a directory): never followed",
                                           field="Object") from None
                    raise
                os.close(fd)
                fd = nfd
            yield fd
        finally:
            if fd is not None:
                os.close(fd)

    def _open_file(self, rel: str):
        """(fd, size) of a plain file, or None when absent; UnsafeObject for anything else."""
        dirs, name = _split(rel)
        with self._dir(dirs) as d:
            if d is None:
                return None
            try:
                fd = os.open(name, _READ_FLAGS, dir_fd=d)
            except FileNotFoundError:
                return None
            except OSError as e:
                if e.errno in _UNSAFE:
                    raise UnsafeObject(f"{rel} is a symbolic link or not a plain file: never followed or read",
                                       field="Object") from None
                raise
        st = os.fstat(fd)
        if not stat_.S_ISREG(st.st_mode):
            os.close(fd)
            raise UnsafeObject(f"{rel} is not a plain file (a FIFO, a device or a directory): never read",
                               field="Object")
        return fd, st.st_size

    # -- reads ---------------------------------------------------------------------------------------------------
    def read(self, rel: str, limit: int) -> bytes | None:
        got = self._open_file(rel)
        if got is None:
            return None
        fd, size = got
        try:
            if size > limit:
                raise LimitExceeded(f"{rel}: {size} bytes, more than the {limit} such an object can hold",
                                    field="Object.size")
            chunks, left = [], size
            while left > 0:
                b = os.read(fd, left)
                if not b:
                    break
                chunks.append(b)
                left -= len(b)
            return b"".join(chunks)
        finally:
            os.close(fd)

    def head(self, rel: str, nbytes: int) -> bytes | None:
        """The first ``nbytes`` of a plain object (its whole size unread), or None when absent."""
        got = self._open_file(rel)
        if got is None:
            return None
        try:
            return os.read(got[0], nbytes)
        finally:
            os.close(got[0])

    def open(self, rel: str):
        """A binary file object of a plain file (for range reads), or None when absent."""
        got = self._open_file(rel)
        if got is None:
            return None
        flags = os.O_RDONLY
        with contextlib.suppress(OSError):  # O_NONBLOCK only guarded the open of a FIFO
            import fcntl

            fcntl.fcntl(got[0], fcntl.F_SETFL, flags)
        return os.fdopen(got[0], "rb")

    def stat(self, rel: str) -> Item | None:
        dirs, name = _split(rel)
        with self._dir(dirs) as d:
            if d is None:
                return None
            try:
                st = os.stat(name, dir_fd=d, follow_symlinks=False)
            except FileNotFoundError:
                return None
        kind = "file" if stat_.S_ISREG(st.st_mode) else "dir" if stat_.S_ISDIR(st.st_mode) else "other"
        return Item(name, kind, st.st_size, st.st_mtime)

    def listdir(self, rel: str, limit: int | None = None) -> list[Item] | None:
        """The names in a directory (None when it is absent, or not a plain directory: never followed), at
        most ``limit`` files."""
        dirs = [p for p in rel.split("/") if p]
        try:
            with self._dir(dirs) as d:
                if d is None:
                    return None
                return list(self._scan(d, limit))
        except UnsafeObject:
            return None

    @staticmethod
    def _scan(d: int, limit: int | None = None):
        n = 0
        with os.scandir(d) as it:
            for e in it:
                try:
                    if e.is_file(follow_symlinks=False):
                        st = e.stat(follow_symlinks=False)
                        yield Item(e.name, "file", st.st_size, st.st_mtime)
                        n += 1
                        if limit is not None and n >= limit:
                            return
                    elif e.is_dir(follow_symlinks=False):
                        yield Item(e.name, "dir")
                    else:
                        yield Item(e.name, "other")
                except FileNotFoundError:  # removed while listed
                    continue

    def walk(self, rel: str):
        """Every name below ``rel``: (relative path, Item), files and "other" entries; directories are entered
        only when they are plain directories."""
        dirs = [p for p in rel.split("/") if p]
        try:
            with self._dir(dirs) as d:
                if d is None:
                    return
                yield from self._walk(d, "/".join(dirs))
        except UnsafeObject:  # not a plain directory: nothing below it is the store's
            return

    def _walk(self, d: int, prefix: str):
        sub = []
        for item in list(self._scan(d)):
            path = f"{prefix}/{item.name}" if prefix else item.name
            if item.kind == "dir":
                sub.append(item.name)
            else:
                yield path, item
        for name in sub:
            try:
                nfd = os.open(name, _DIR_FLAGS, dir_fd=d)
            except OSError:  # gone, or replaced by a link meanwhile: not entered
                continue
            try:
                yield from self._walk(nfd, f"{prefix}/{name}" if prefix else name)
            finally:
                os.close(nfd)

    # -- writes --------------------------------------------------------------------------------------------------
    def write(self, rel: str, data: bytes, *, create: bool = False) -> bool:
        """Publish ``data`` at ``rel`` atomically; ``create``: only if nothing has the name (returns False
        then).  A temporary file that vanishes before its rename (a collector that judged it abandoned) is
        written again."""
        dirs, name = _split(rel)
        for attempt in range(3):
            try:
                return self._write(dirs, name, data, create)
            except FileNotFoundError:
                if attempt == 2:
                    raise
        return False

    def _write(self, dirs, name, data, create) -> bool:
        with self._dir(dirs, create=True) as d:
            tmp = f".{name[:64]}.{secrets.token_hex(8)}{TEMP_SUFFIX}"
            fd = os.open(tmp, _NEW_FLAGS, 0o666, dir_fd=d)
            try:
                try:
                    hold(fd)  # held while it is written: a collector never takes a live writer's file
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view):]
                    os.fsync(fd)
                finally:
                    os.close(fd)
                if create:
                    try:
                        os.link(tmp, name, src_dir_fd=d, dst_dir_fd=d, follow_symlinks=False)
                    except FileExistsError:
                        return False
                    finally:
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(tmp, dir_fd=d)
                else:
                    try:
                        os.rename(tmp, name, src_dir_fd=d, dst_dir_fd=d)
                    except IsADirectoryError:
                        raise UnsafeObject(f"{'/'.join(dirs + [name])} is a directory where an object belongs",
                                           field="Object") from None
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=d)
                raise
            with contextlib.suppress(OSError):  # some file systems refuse fsync on directories
                os.fsync(d)
            return True

    def in_use(self, rel: str) -> bool:
        """Is a temporary file being written now (its writer holds a lock on it, whatever its process id
        namespace or host name)?"""
        got = self._open_file(rel)
        if got is None:
            return False
        try:
            return held_elsewhere(got[0])
        finally:
            os.close(got[0])

    def delete(self, rel: str) -> int:
        """Remove a plain file; its size, or -1 when it was not there (or is not a plain file: never
        removed through)."""
        dirs, name = _split(rel)
        with self._dir(dirs) as d:
            if d is None:
                return -1
            try:
                st = os.stat(name, dir_fd=d, follow_symlinks=False)
                if not stat_.S_ISREG(st.st_mode):
                    return -1
                os.unlink(name, dir_fd=d)
            except FileNotFoundError:
                return -1
            return st.st_size

    def delete_many(self, rels: list[str]) -> int:
        return sum(max(0, self.delete(r)) for r in rels)

    def move(self, rel: str, dest: str) -> bool:
        """Rename an object (a link or special file too: the name moves, nothing is followed)."""
        sdirs, sname = _split(rel)
        ddirs, dname = _split(dest)
        with self._dir(sdirs) as s, self._dir(ddirs, create=True) as d:
            if s is None:
                return False
            try:
                os.rename(sname, dname, src_dir_fd=s, dst_dir_fd=d)
            except FileNotFoundError:
                return False
            return True

    def touch(self, rel: str) -> None:
        """Mark a plain file as used now (what LRU eviction orders by); best effort."""
        dirs, name = _split(rel)
        with contextlib.suppress(OSError, UnsafeObject), self._dir(dirs) as d:
            if d is not None:
                os.utime(name, dir_fd=d, follow_symlinks=False)

    def clock(self) -> float:
        """The store's time now: the modification time of an object written just now."""
        self.write("gc/clock", secrets.token_bytes(8))
        st = self.stat("gc/clock")
        return st.mtime if st is not None else time.time()

    def remove_empty_dirs(self, rel: str) -> None:
        """Remove the empty directories below ``rel`` (best effort: a writer may be creating one)."""
        dirs = [p for p in rel.split("/") if p]
        with contextlib.suppress(UnsafeObject), self._dir(dirs) as d:
            if d is not None:
                self._prune(d)

    def _prune(self, d: int) -> bool:
        empty = True
        for item in list(self._scan(d)):
            if item.kind != "dir":
                empty = False
                continue
            try:
                nfd = os.open(item.name, _DIR_FLAGS, dir_fd=d)
            except OSError:
                empty = False
                continue
            try:
                sub_empty = self._prune(nfd)
            finally:
                os.close(nfd)
            if sub_empty:
                try:
                    os.rmdir(item.name, dir_fd=d)
                except OSError:
                    empty = False
            else:
                empty = False
        return empty

    # -- the collector's lock --------------------------------------------------------------------------------
    def lock(self):
        """An exclusive, non-blocking lock on ``gc/lock`` held until the returned file is closed (the kernel
        releases it when the process dies); None when another process holds it."""
        import fcntl

        with self._dir(["gc"], create=True) as d:
            try:
                fd = os.open("lock", os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
                             | getattr(os, "O_CLOEXEC", 0), 0o666, dir_fd=d)
            except OSError as e:
                if e.errno in _UNSAFE:
                    raise UnsafeObject("gc/lock is a symbolic link or not a plain file: remove it (no collector "
                                       "follows it)", field="Object") from None
                raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        return fd

    def unlock(self, handle) -> None:
        if handle is not None:
            os.close(handle)

    def lock_held(self) -> bool:
        """Does some process hold the collector's lock now?"""
        with self._dir(["gc"]) as d:
            if d is None:
                return False
            try:
                fd = os.open("lock", os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0),
                             dir_fd=d)
            except OSError:
                return False
        try:
            return held_elsewhere(fd, shared=True)
        finally:
            os.close(fd)


class FsspecBackend:
    """An fsspec file system (S3 through s3fs, or any other): objects are plain by construction.  Conditional
    writes (``If-None-Match`` / ``If-Match``) are used where the file system offers them (s3fs); elsewhere a
    create is a check then a write, which one collector at a time does not need."""

    local = False

    def __init__(self, fs, root: str):
        self.fs, self.root = fs, root.rstrip("/")
        protocol = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
        self.s3 = any(p in ("s3", "s3a") for p in protocol)
        self.conditional = self.s3

    def describe(self) -> str:
        proto = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        return f"{proto}://{self.root}"

    def _abs(self, rel: str) -> str:
        _split(rel)
        return f"{self.root}/{rel}" if self.root else rel

    def root_exists(self) -> bool:
        self.fs.invalidate_cache(self.root)
        try:
            if self.s3 and "/" not in self.root:
                return bool(self.fs.exists(self.root))
            return bool(self.fs.exists(self.root)) or bool(self.fs.find(self.root, maxdepth=1))
        except (FileNotFoundError, PermissionError):
            return False

    def read(self, rel: str, limit: int) -> bytes | None:
        path = self._abs(rel)
        try:
            data = self.fs.cat_file(path, start=0, end=limit + 1)
        except FileNotFoundError:
            return None
        except IsADirectoryError:
            raise UnsafeObject(f"{rel} is a directory where an object belongs", field="Object") from None
        if len(data) > limit:
            raise LimitExceeded(f"{rel}: more than the {limit} bytes such an object can hold", field="Object.size")
        return data

    def head(self, rel: str, nbytes: int) -> bytes | None:
        try:
            return self.fs.cat_file(self._abs(rel), start=0, end=nbytes)
        except FileNotFoundError:
            return None

    def open(self, rel: str):
        try:
            return self.fs.open(self._abs(rel), "rb")
        except FileNotFoundError:
            return None

    def _item(self, name: str, info: dict) -> Item:
        kind = "file" if info.get("type", "file") == "file" else "dir" if info.get("type") == "directory" else "other"
        t = info.get("mtime") or info.get("LastModified") or info.get("last_modified") or info.get("created") or 0
        return Item(name, kind, int(info.get("size") or info.get("Size") or 0), _timestamp(t), info.get("ETag"))

    def stat(self, rel: str) -> Item | None:
        path = self._abs(rel)
        name = rel.rsplit("/", 1)[-1]
        if self.s3:  # one HEAD (s3fs's info() adds a listing for a missing key, to find "directories")
            bucket, _, key = path.partition("/")
            try:
                h = self.fs.call_s3("head_object", Bucket=bucket, Key=key)
            except FileNotFoundError:
                return None
            return Item(name, "file", int(h.get("ContentLength", 0)), _timestamp(h.get("LastModified")),
                        h.get("ETag"))
        self.fs.invalidate_cache(path)
        try:
            info = self.fs.info(path)
        except FileNotFoundError:
            return None
        return self._item(name, info)

    def listdir(self, rel: str, limit: int | None = None) -> list[Item] | None:
        path = self._abs(rel)
        if self.s3 and limit is not None:  # one request: the first `limit` keys under the prefix
            bucket, _, key = path.partition("/")
            r = self.fs.call_s3("list_objects_v2", Bucket=bucket, Prefix=key.rstrip("/") + "/", MaxKeys=limit,
                                Delimiter="/")
            items = [self._item(c["Key"].rsplit("/", 1)[-1], {**c, "type": "file"}) for c in r.get("Contents", [])]
            items += [Item(p["Prefix"].rstrip("/").rsplit("/", 1)[-1], "dir") for p in r.get("CommonPrefixes", [])]
            return items or None
        self.fs.invalidate_cache(path)
        try:
            found = self.fs.ls(path, detail=True)
        except (FileNotFoundError, NotADirectoryError):
            return None
        return [self._item(i["name"].rstrip("/").rsplit("/", 1)[-1], i) for i in found] or None

    def walk(self, rel: str):
        path = self._abs(rel)
        self.fs.invalidate_cache()
        try:
            found = self.fs.find(path, detail=True)
        except FileNotFoundError:
            return
        base = self.root + "/" if self.root else ""  # find() names paths as url_to_fs named the root
        for p, info in sorted(found.items()):
            if p.startswith(base):
                rel_path = p[len(base):]
                yield rel_path, self._item(rel_path.rsplit("/", 1)[-1], info)

    def write(self, rel: str, data: bytes, *, create: bool = False, if_match: str | None = None) -> bool:
        path = self._abs(rel)
        if create and not self.conditional:
            if self.stat(rel) is not None:
                return False
            self.fs.pipe_file(path, data)
            return True
        kw = {}
        if create:
            kw["mode"] = "create"
        if if_match is not None:
            kw["IfMatch"] = if_match
        try:
            self.fs.pipe_file(path, data, **kw)
        except FileExistsError:
            return False
        except OSError as e:
            if if_match is not None and "pre-condition" in str(e).lower():
                return False
            raise
        return True

    def delete(self, rel: str) -> int:
        st = self.stat(rel)
        if st is None:
            return -1
        try:
            self.fs.rm_file(self._abs(rel))
        except FileNotFoundError:
            return -1
        return st.size

    def delete_many(self, rels: list[str]) -> int:
        if not rels:
            return 0
        try:
            self.fs.rm([self._abs(r) for r in rels])
        except FileNotFoundError:
            for r in rels:
                self.delete(r)
        return 0

    def move(self, rel: str, dest: str) -> bool:
        try:
            self.fs.mv(self._abs(rel), self._abs(dest))
        except FileNotFoundError:
            return False
        return True

    def touch(self, rel: str) -> None:
        """Object stores have no cheap way to refresh a time: eviction there is by write time."""

    def in_use(self, rel: str) -> bool:
        return False

    def clock(self) -> float:
        self.write("gc/clock", secrets.token_bytes(8))
        st = self.stat("gc/clock")
        return st.mtime if st is not None and st.mtime else time.time()

    def remove_empty_dirs(self, rel: str) -> None:
        """Object stores have no directories."""

    def lock(self):  # object stores: the lease object (lease.py) is the lock
        return None

    def unlock(self, handle) -> None:
        pass

    def lock_held(self) -> bool:
        return False


def backend_for(url, storage_options: dict | None = None):
    """The backend of a store URL: a local path (or ``file://``) gets :class:`LocalBackend`; any other fsspec
    URL :class:`FsspecBackend`."""
    import fsspec

    url = os.fspath(url)
    fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
    protocol = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    if "file" in protocol or "local" in protocol:
        return LocalBackend(root)
    if not any(p in ("s3", "s3a") for p in protocol):
        warn(f"kvcodec.Store: {url}: this file system offers no conditional write through fsspec; run one "
             "collector (gc) at a time on it (spec/store.md 7)")
    return FsspecBackend(fs, root)

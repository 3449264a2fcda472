"""Crash- and race-safe file replacement for local paths.

:func:`atomic_output` writes to a temporary file in the target's directory whose
name is unique to the writer (``.<name>.<host>-<pid>-<random>.kvz-tmp``), flushes and
fsyncs it, renames it over the target (``os.replace``: atomic on POSIX and
Windows) and fsyncs the directory, so that:

* a reader sees either the old file or the complete new one, never a prefix;
* two writers of the same path never share a temporary file: the last rename
  wins and leaves a complete, valid file;
* a failed write removes its temporary file; a writer killed outright
  (``kill -9``, power loss) can leave one behind, which the next write to the
  same target *on the same host* removes once no process holds it: a writer
  holds an exclusive ``flock`` on its temporary file while it writes, which the
  kernel drops when the writer dies.  A process id is not used to judge another
  writer: containers sharing a volume and a host name see different process
  ids (``<host>``, a hash of the host name, keeps other machines' files on a
  shared file system out of the sweep).

URLs (fsspec) are written directly: object stores publish an object only when
its upload completes.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import socket

from .errors import ConfigError

SUFFIX = ".kvz-tmp"


#: this machine, in temporary file names (8 hex digits of the host name's SHA-256)
HOST = hashlib.sha256(socket.gethostname().encode("utf-8", "replace")).hexdigest()[:8]


def _temp_name(target: str) -> str:
    d, base = os.path.split(target)
    return os.path.join(d, f".{base}.{HOST}-{os.getpid()}-{secrets.token_hex(4)}{SUFFIX}")


def hold(fd: int) -> None:
    """Take an exclusive ``flock`` on an open file, kept until it is closed (the kernel drops it when the
    process dies); nothing where this system has no such locks."""
    try:
        import fcntl

        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except (ImportError, OSError):
        pass


def held_elsewhere(fd: int, *, shared: bool = False) -> bool:
    """Does another open file hold a lock on this file that conflicts with ours (an exclusive one: any lock;
    ``shared``: an exclusive one)?  True where this system has no such locks (unknown: assume held)."""
    try:
        import fcntl
    except ImportError:
        return True
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return True
    return False


def _held(path: str) -> bool:
    """Does a live writer hold this temporary file?"""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return True
    try:
        return held_elsewhere(fd)
    finally:
        os.close(fd)


def _alive(pid_text: str) -> bool:
    """Is the process of this host whose id a temporary file's name carries alive (or unknowable)?"""
    try:
        pid = int(pid_text)
    except ValueError:
        return False
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True  # it exists (another user's), or this system cannot tell
    return True


def sweep_stale(target: str) -> list[str]:
    """Remove the temporary files that dead writers *of this host* left for ``target``; returns their
    paths (other hosts' are never judged by a local process id)."""
    d, base = os.path.split(os.path.abspath(target))
    prefix = f".{base}."
    gone = []
    try:
        names = os.listdir(d)
    except OSError:
        return gone
    for name in names:
        if not (name.startswith(prefix) and name.endswith(SUFFIX)):
            continue
        parts = name[len(prefix):-len(SUFFIX)].split("-")
        if len(parts) != 3 or parts[0] != HOST:
            continue
        path = os.path.join(d, name)
        # a writer of this host still alive is never judged by its lock: between creating its file and locking
        # it there is a moment when the file is not locked (seen: a second writer swept the first's file)
        if _alive(parts[1]):
            continue
        if not os.path.islink(path) and not _held(path):
            with contextlib.suppress(OSError):
                os.remove(path)
                gone.append(path)
    return gone


def _fsync_dir(d: str) -> None:
    if os.name != "posix":
        return
    fd = os.open(d or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on directories
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_output(target, *, overwrite: bool = True):
    """``with atomic_output(path) as f: f.write(...)``: ``path`` appears complete or not at all.

    With ``overwrite=False`` an existing target is refused before anything is
    written (:class:`~kvcodec.errors.ConfigError`), and a target created by
    someone else meanwhile is not replaced (``FileExistsError``).  The parent
    directory must exist (``FileNotFoundError`` otherwise: it is not created).
    """
    target = os.fspath(target)
    if not overwrite and os.path.lexists(target):
        raise ConfigError(f"{target} exists (pass overwrite=True, or -f on the command line, to replace it)")
    d = os.path.dirname(os.path.abspath(target))
    if not os.path.isdir(d):
        raise FileNotFoundError(f"directory {d} does not exist")
    sweep_stale(target)
    tmp = _temp_name(target)
    f = open(tmp, "xb")
    try:
        hold(f.fileno())  # held until closed: a live writer's file is never swept
        yield f
        f.flush()
        os.fsync(f.fileno())
        # renamed while still open and locked: closing first let another writer's sweep take the file for a dead
        # writer's between the close and the rename (tests/test_hostile.py, two writers, seen in CI)
        if overwrite:
            os.replace(tmp, target)
        else:
            try:
                os.link(tmp, target)  # fails if the target appeared meanwhile
            except FileExistsError:
                raise
            except OSError:  # no hard links on this file system: check, then rename
                if os.path.lexists(target):
                    raise FileExistsError(target) from None
                os.replace(tmp, target)
            else:
                os.remove(tmp)
        f.close()
        _fsync_dir(d)
    except BaseException:
        f.close()
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise

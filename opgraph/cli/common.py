"""What every CLI command shares: the one-line error convention, argument types, formatting,
the memory limit and file output. Op_api options and cases are in :mod:`opgraph.cli.cases`.

    >>> parse_shape("2,3,1,4"), fmt_status(0)
    ((2, 3, 1, 4), '0 (ACLNN_SUCCESS)')
"""
from __future__ import annotations

import argparse
import errno
import math
import os
import re
import sys
import tempfile
from typing import Callable, Optional, Sequence

import numpy as np

from opgraph.core.backend import BackendUnavailable, get
from opgraph.core.dtypes import DataType, dtype_of
from opgraph.core.platform import lookup
from opgraph.core.status import Status
from opgraph.core.tensor import Tensor


class CliError(Exception):
    """A user-facing failure: ``main`` prints ``opgraph: error: <message>`` and exits ``code``."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are ONE line on stderr (exit status 2) pointing to
    the help of the (sub)command that rejected them, and whose --help and --version output
    failing to write (a full disk) is an OSError, not a silent exit 0."""

    def error(self, message: str) -> None:  # type: ignore[override]
        """Exit with status 2 after ONE line on stderr naming this (sub)command's ``--help`` (not
        argparse's usage block)."""
        self.exit(2, f"opgraph: error: {message} (see '{self.prog} --help')\n")

    def parse_known_args(self, args: Optional[Sequence[str]] = None,  # type: ignore[override]
                         namespace: Optional[argparse.Namespace] = None
                         ) -> tuple[argparse.Namespace, list[str]]:
        """Unknown arguments are rejected by the (sub)command that got them (argparse leaves
        that to the top-level parser, whose help does not list the subcommand's options)."""
        ns, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return ns, extras

    def _print_message(self, message: str, file=None) -> None:  # argparse ignores OSError
        if message:
            (file or sys.stderr).write(message)


def called_exit(e: SystemExit) -> str:
    """What user code did that ended in ``e``: ``'called sys.exit(0)'``, for a one-line error.

    >>> called_exit(SystemExit("bye"))
    "called sys.exit('bye')"
    """
    return f"called sys.exit({'' if e.code is None else repr(e.code)})"


def fmt_status(status: Status) -> str:
    """``'0 (ACLNN_SUCCESS)'``: the C return value and its name."""
    return f"{int(status)} ({Status(status).name})"


def fmt_type(a: "np.ndarray | Tensor | None") -> str:
    """``'f16[2,3,1,4]'`` like the graph dumps (``'NULL'`` for None)."""
    if a is None:
        return "NULL"
    return f"{dtype_of(a.dtype).short}[{','.join(map(str, a.shape))}]"


def fmt_values(a: np.ndarray, n: int = 6) -> str:
    """The first ``n`` values of ``a`` as floats, e.g. ``'[0.5, -1.25, ...] (24 values)'``."""
    flat = np.asarray(a).reshape(-1)
    head = ", ".join(f"{float(v):.6g}" for v in flat[:n])
    more = ", ..." if flat.size > n else ""
    return f"[{head}{more}] ({flat.size} values)"


def counted(n: int, singular: str, plural: str = "") -> str:
    """``n`` and its noun: ``singular`` when n is 1, else ``plural`` (default: singular + "s").

    >>> counted(1, "launch", "launches"), counted(3, "launch", "launches"), counted(0, "node")
    ('1 launch', '3 launches', '0 nodes')
    """
    return f"{n} {singular if n == 1 else plural or singular + 's'}"


def fmt_bytes(n: int) -> str:
    """A byte count for people: ``'512 B'``, ``'1.5 KiB'``, ``'768.0 GiB'``, ``'over 1 ZiB'``.

    >>> fmt_bytes(512), fmt_bytes(1536), fmt_bytes(768 * 2**30), fmt_bytes(10**400)
    ('512 B', '1.5 KiB', '768.0 GiB', 'over 1 ZiB')
    """
    if n < 1024:
        return f"{n} B"
    if n >= 2**70:
        return "over 1 ZiB"
    units = ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB")
    power = min((n.bit_length() - 1) // 10, len(units))
    return f"{n / 2**(10 * power):.1f} {units[power - 1]}"


# --- memory: refuse, before allocating, what would not fit ------------------------------------
MEMORY_SHARE = 8  # a command's arrays may take 1/8 of physical memory; the rest is for temporaries
FALLBACK_MEMORY = 16 * 2**30  # assumed where os.sysconf cannot tell


def physical_memory() -> int:
    """Bytes of physical memory (``SC_PHYS_PAGES * SC_PAGE_SIZE``; 16 GiB where unknown)."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return FALLBACK_MEMORY
    return total if total > 0 else FALLBACK_MEMORY


def check_memory(shape: tuple[int, ...], nbytes: int, what: str, also: str = "") -> None:
    """CliError naming --shape (and ``also``, the other options that size the arrays, e.g.
    ``' --ranks 9'``) when ``what`` would take more than 1/MEMORY_SHARE of memory.

    >>> check_memory((2, 3), 96, "the inputs and output")
    >>> check_memory((2**40, 3), 12 * 2**42, "the inputs and output")
    Traceback (most recent call last):
    ...
    opgraph.cli.common.CliError: --shape 1099511627776,3: the inputs and output need 48.0 TiB, ...
    """
    total = physical_memory()
    limit = total // MEMORY_SHARE
    if nbytes > limit:
        need, allowed = fmt_bytes(nbytes), fmt_bytes(limit)
        if need == allowed:  # too close to tell apart when rounded
            need, allowed = f"{nbytes} B", f"{limit} B"
        given = f"--shape {','.join(map(str, shape))}{also}"
        raise CliError(f"{given}: {what} need {need}, more than the limit of {allowed} "
                       f"(1/{MEMORY_SHARE} of the {fmt_bytes(total)} of physical memory)", code=2)


# --- argument types (raise ArgumentTypeError: argparse turns it into one line) ------------------
MAX_ELEMENTS = 2**60  # numpy's size limit for float64 arrays (the inputs are drawn in float64)
MAX_RANK = 32  # the most dims numpy 1.x arrays have (2.x: 64)


_INTEGER = re.compile(r"-?[0-9]+")


def parse_int(text: str) -> int:
    """A decimal integer in ASCII digits, an optional ``-`` first (``int()`` would also take
    ``2_0``, ``+2`` and full-width digits, which a shape or count should not be).

    >>> parse_int(" -12 "), parse_int("7")
    (-12, 7)
    >>> parse_int("2_0")
    Traceback (most recent call last):
    ...
    ValueError: not a decimal integer: '2_0'
    """
    t = text.strip()
    if not _INTEGER.fullmatch(t):
        raise ValueError(f"not a decimal integer: {text!r}")
    return int(t)


def integer_option(text: str) -> int:
    """:func:`parse_int` for an argparse option (an op's integer option, ``--ranks``)."""
    try:
        return parse_int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a decimal integer, got {text!r}") from None


def parse_shape(text: str) -> tuple[int, ...]:
    """``"2,3,1,4"`` → ``(2, 3, 1, 4)``; at most 32 non-negative integer dims. An empty shape's
    non-zero dims must multiply to less than 2**60, or numpy cannot describe it (the memory a
    non-empty shape needs is checked by the command).

    >>> parse_shape("2, 3,1,4")
    (2, 3, 1, 4)
    >>> parse_shape(f"{2**40},{2**20},0")
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: bad shape '1099511627776,1048576,0': ...below 2**60...
    """
    parts = [p.strip() for p in text.split(",")]
    try:
        dims = tuple(parse_int(p) for p in parts)
    except ValueError:
        dims = ()
    if not dims or any(d < 0 for d in dims):
        raise argparse.ArgumentTypeError(
            f"bad shape {text!r}: expected comma-separated non-negative integers, e.g. 2,3,1,4")
    if len(dims) > MAX_RANK:
        raise argparse.ArgumentTypeError(
            f"bad shape: {len(dims)} dims, numpy arrays have at most {MAX_RANK}")
    if 0 in dims and math.prod(d for d in dims if d) >= MAX_ELEMENTS:
        raise argparse.ArgumentTypeError(
            f"bad shape {text!r}: the non-zero dims of an empty shape must multiply to below "
            f"2**60, numpy's array size limit")
    return dims


def _int_at_least(text: str, low: int) -> int:
    try:
        n = parse_int(text)
    except ValueError:
        n = low - 1
    if n < low:
        raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}")
    return n


def non_negative_int(text: str) -> int:
    """An integer >= 0 (``--embed-limit``)."""
    return _int_at_least(text, 0)


MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed takes 64 bits; rank offsets need headroom


def parse_seed(text: str) -> int:
    """A random seed, ``0 .. 2**63 - 1`` (``--seed``).

    >>> parse_seed(str(2**63))
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: expected an integer from 0 to 2**63-1, got '9223372036854775808'
    """
    n = _int_at_least(text, 0)
    if n > MAX_SEED:
        raise argparse.ArgumentTypeError(f"expected an integer from 0 to 2**63-1, got {text!r}")
    return n


def positive_int(text: str) -> int:
    """An integer >= 1 (``--cores``, ``--ub``)."""
    return _int_at_least(text, 1)


def parse_dtype(text: str) -> DataType:
    """A dtype name opgraph understands (``float16``, ``f16``, ``bfloat16``, ``int32`` ...)."""
    try:
        d = dtype_of(text)
        d.np  # noqa: B018  (must be holdable by numpy)
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return d


def parse_platform(text: str) -> str:
    """A SoC preset name (``Ascend910B``, ``Ascend950`` ...)."""
    try:
        return lookup(text).soc
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_backend(text: str) -> str:
    """A backend that is registered and available here."""
    try:
        get(text)
    except BackendUnavailable as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def conflict(first: str, second: str, why: str) -> CliError:
    """The usage error of two options that cannot be given together (one would be ignored)."""
    return CliError(f"{first} and {second} cannot be combined: {why}", code=2)


def names_stdout(path: "str | None") -> bool:
    """Whether ``path`` is this process's stdout: None, '-', or another name of the file stdout
    is (``/dev/stdout``, ``/dev/fd/1``, the file stdout is redirected to), which is written as
    stdout: in order with what is printed, and with no 'wrote ...' line mixed into it.

    >>> names_stdout("-"), names_stdout("/nonexistent/x")
    (True, False)
    """
    if path in (None, "-"):
        return True
    try:
        return os.path.samestat(os.stat(path), os.fstat(sys.stdout.fileno()))
    except (OSError, ValueError, AttributeError):  # (no such file; stdout is no real file)
        return False


def same_path(a: str, b: str) -> bool:
    """Whether paths ``a`` and ``b`` name the same file (existing or not; links followed)."""
    if os.path.exists(a) and os.path.exists(b):
        return os.path.samefile(a, b)
    return os.path.realpath(a) == os.path.realpath(b)


READ_FILES: list[str] = []  # the files this command reads as code: --load's .py files, capture's FILE


def check_output(path: "str | None", option: str = "-o/--output") -> None:
    """CliError naming ``option`` unless ``path`` could be written (None or '-': stdout) and is
    none of the :data:`READ_FILES` (which it would overwrite): a command with several outputs
    checks them all before writing any, so a rejected call leaves every output untouched.

    >>> check_output("/nonexistent/x")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    opgraph.cli.common.CliError: -o/--output: cannot write '/nonexistent/x': No such file ...
    """
    if path in (None, "-"):
        return
    read = next((f for f in READ_FILES if path and same_path(path, f)), None)
    if read is not None:
        raise CliError(f"{option} {path!r}: is {read!r}, which this command reads; it would "
                       "overwrite it", code=2)
    folder = os.path.dirname(os.path.abspath(path)) if path else ""
    if not path:
        code = errno.ENOENT
    elif path.endswith(("/", os.sep)) and not os.path.isdir(path):
        raise CliError(f"{option}: {path!r} names a directory (it ends in {path[-1]!r}), not a file")
    elif os.path.isdir(path):
        code = errno.EISDIR
    elif not os.path.isdir(folder):
        code = errno.ENOTDIR if os.path.exists(folder) else errno.ENOENT
    elif not os.access(path if os.path.exists(path) else folder, os.W_OK):
        code = errno.EACCES
    else:
        return
    raise CliError(f"{option}: cannot write {path!r}: {os.strerror(code)}")


def write_output(text: "str | bytes", path: "str | None", summary: "str | None" = None,
                 option: str = "-o/--output",
                 also: Sequence[tuple[str, "str | bytes", str]] = ()) -> int:
    """Write ``text`` to stdout (``path`` None or '-') or to ``path`` (bytes: binary), together
    with the files ``also`` (``(path, content, option)``: all or none, see :func:`write_files`),
    then print ``summary`` when ``path`` was a file; a failed write is a CliError naming its
    option and leaves every path as it was. ``path`` is checked like :func:`check_output` (its
    directory must exist: only ``also``'s files, such as --dump-dir's, get directories made)."""
    path = "-" if names_stdout(path) else path
    check_output(path, option)
    write_files([*also, (path, text, option)])
    if summary and path not in (None, "-"):
        print(f"wrote {path}: {summary}")
    return 0


def write_files(files: Sequence[tuple["str | None", "str | bytes", str]]) -> None:
    """Write every ``(path, content, option)`` or none: each file's content goes to a temporary
    file beside it, and only once all are written are they renamed into place (a device, a
    FIFO or a file in a directory that cannot take a temporary is written in place after them;
    ``path`` None or '-' is stdout). On a failed write the temporaries and any directory made
    for them are removed, every path keeps what it held, and a CliError names the option and
    the path. Two files at one path are a CliError before anything is written.

    >>> import tempfile; d = tempfile.mkdtemp()
    >>> write_files([(os.path.join(d, "a.txt"), "A", "-o"), (os.path.join(d, "sub", "b.bin"), b"B", "--x")])
    >>> sorted(os.listdir(d)), open(os.path.join(d, "sub", "b.bin"), "rb").read()
    (['a.txt', 'sub'], b'B')
    """
    first: dict[str, int] = {}  # real path -> the index of the first file written there
    for k, (path, _, option) in enumerate(files):
        if path not in (None, "-") and first.setdefault(os.path.realpath(path), k) != k:
            other = files[first[os.path.realpath(path)]][2]  # one would replace the other
            raise CliError(f"{option} {path!r}: {other} writes the same file", code=2)
    staged: list[tuple[str, str]] = []  # (temporary, final path)
    made: list[str] = []  # directories made for the files, outermost first
    try:
        in_place = []
        for path, content, option in files:
            if path in (None, "-") or (os.path.exists(path) and not os.path.isfile(path)) or (
                    os.path.isfile(path) and not os.access(os.path.dirname(os.path.realpath(path)), os.W_OK)):
                in_place.append((path, content, option))  # (a writable file in a directory that
                continue  # is not: no temporary can go beside it, so it is written in place)
            data = content.encode("utf-8") if isinstance(content, str) else content
            target = os.path.realpath(path)  # (a symlink's file is replaced, not the link)
            try:
                if not path or os.path.isdir(target):
                    raise OSError(errno.EISDIR if path else errno.ENOENT,
                                  os.strerror(errno.EISDIR if path else errno.ENOENT))
                made += _make_dirs(os.path.dirname(target))
                fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target),
                                           prefix=f".{os.path.basename(target)}.", suffix=".tmp")
                staged.append((tmp, target))
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.chmod(tmp, _file_mode(target))
            except OSError as e:
                raise CliError(f"{option}: cannot write {path!r}: {e.strerror or e}") from None
        for path, content, option in in_place:
            _write_in_place(path, content, option)
    except BaseException:
        for tmp, _ in staged:
            _remove(tmp, os.unlink)
        for folder in reversed(made):
            _remove(folder, os.rmdir)
        raise
    for k, (tmp, target) in enumerate(staged):
        try:
            os.replace(tmp, target)
        except OSError as e:  # (a rename in one directory: only a race gets here)
            for left, _ in staged[k:]:
                _remove(left, os.unlink)
            raise CliError(f"cannot write {target!r}: {e.strerror or e}") from None


def _write_in_place(path: "str | None", content: "str | bytes", option: str) -> None:
    """Write stdout (``path`` None or '-'; bytes to its binary buffer) or a device or FIFO."""
    if path in (None, "-"):
        if isinstance(content, bytes):
            sys.stdout.flush()
            sys.stdout.buffer.write(content)
        else:
            sys.stdout.write(content)
        return
    try:
        with open(path, "wb") as f:
            f.write(content.encode("utf-8") if isinstance(content, str) else content)
    except OSError as e:
        raise CliError(f"{option}: cannot write {path!r}: {e.strerror or e}") from None


def _make_dirs(folder: str) -> list[str]:
    """Make ``folder`` and its missing parents; returns those it made, outermost first."""
    missing = []
    while folder and not os.path.isdir(folder):
        missing.append(folder)
        folder = os.path.dirname(folder)
    for d in reversed(missing):
        os.mkdir(d)
    return list(reversed(missing))


def _file_mode(path: str) -> int:
    """The mode a file written at ``path`` gets: the file's own if it exists, else 0666 less
    the umask (what ``open(path, "w")`` would give)."""
    try:
        return os.stat(path).st_mode & 0o7777
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def _remove(path: str, how: Callable[[str], None]) -> None:
    try:
        how(path)
    except OSError:
        pass


def check_fast_math_level(fast: bool, level: int, why: str = "") -> None:
    """--fast-math with a level below 2 is refused: the rewrites join level 2 only (levels 0
    and 1 are as recorded and what CANN launches)."""
    if fast and level != 2:
        raise CliError(f"--fast-math: the fast-math rewrites join level 2 only, not level "
                       f"{level}{why}", code=2)


def add_fast_math_option(p: argparse.ArgumentParser) -> None:
    """``--fast-math``, as every command that compiles takes it."""
    p.add_argument("--fast-math", action="store_true",
                   help="compile level 2 with the opt-in, NOT bit-exact fast-math rewrites")

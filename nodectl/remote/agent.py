"""Calling runctl (launchers/runctl/) on a node: shipped as one artifact, installed once per version under
<workdir>/.nodectl/, checked before every call, then called with argv and a JSON request on stdin, answering one
JSON document."""
from __future__ import annotations

import hashlib
import io
import json
import shlex
import zipfile
from contextlib import contextmanager
from functools import lru_cache

from nodectl.resources import resource_dir
from nodectl.resources.launchers.nodeio import last_json
from nodectl.remote import answers
from nodectl.terminal_text import visible
from nodectl.transport import CommandTimeout, LineStream, NodeError, NodeErrorKind, Transport, quote_path

AGENT_TIMEOUT = 120.0


class AgentError(NodeError):
    """runctl answered with an error, or not with JSON."""


class NoRun(AgentError):
    """The node has no such run: never prepared there, or removed (a NodeResult's `no_run`)."""

    def __init__(self, message: str, **kwargs) -> None:
        super().__init__(message, kind=NodeErrorKind.NO_RUN, **kwargs)


# The artifact's own __main__: its modules' code compiled once per node and Python, kept beside it
# (launchers/codecache.py), then the command.
MAIN = (b"import os\n\nimport codecache\n\ncodecache.install(os.path.dirname(__file__))\n"
        b"from runctl.dispatch import main\n\nmain()\n")


@lru_cache(maxsize=1)
def _runctl() -> tuple[bytes, str, str]:
    """runctl's artifact: the package launchers/runctl/, the loader of its code compiled on the node
    (launchers/codecache.py), the run folder's layout (launchers/runlayout.py), the answers' reader and whole-file
    writer (launchers/nodeio.py), the pace's reading of the flight recorder (launchers/flightpace.py), the table of
    verbs (launchers/verbs.py), the secret rules (launchers/redaction.py: collect masks what ranks wrote), the
    /etc/hosts reader (launchers/hostsfile.py) and the port picker (launchers/ports.py), all but the package and
    its loader imported by the controller too, as one zip with a __main__ (`python -S FILE` runs it); the short hash that names it on the nodes, and its full sha256. Every controller of
    one version builds the same bytes: entries in order, fixed times and modes, stored uncompressed."""
    launchers = resource_dir("launchers")
    buffer = io.BytesIO()
    beside = ("codecache.py", "runlayout.py", "nodeio.py", "flightpace.py", "verbs.py", "redaction.py", "hostsfile.py",
              "ports.py")
    entries = [("__main__.py", MAIN), *((name, (launchers / name).read_bytes()) for name in beside),
               *((f"runctl/{path.name}", path.read_bytes()) for path in sorted((launchers / "runctl").glob("*.py")))]
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        for name, data in entries:
            info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            archive.writestr(info, data)
    artifact = buffer.getvalue()
    digest = hashlib.sha256(artifact).hexdigest()
    return artifact, digest[:16], digest


def agent_path(workdir: str) -> str:
    return f"{workdir.rstrip('/')}/.nodectl/runctl-{_runctl()[1]}.pyz"


MISSING = "NODECTL-RUNCTL-MISSING"
# What runs the checked artifact `p` in the same process: its modules from the code compiled and kept beside it
# (launchers/codecache.py), then the command. As the artifact's __main__ does, without runpy (and what it imports:
# about a quarter of a call's CPU once the code is kept).
RUN = "sys.path.insert(0,p);import codecache;codecache.install(p);from runctl.dispatch import main;main()"


# Runs the installed runctl only after checking it, in the same process: the folder and the file are the login
# user's and writable by nobody else, and the bytes hash to this version's sha256. Python's zip import then reads
# the same file again; between the check and that read only the login user (or root) can change it, since nobody
# else may write in that folder or to that file. A file planted by another user in a shared workdir (a world-writable /tmp/scratch) is never executed: the
# marker comes back and runctl is installed anew (or, in a folder that user owns, installing fails and says so).
# One line without a backslash or a single quote, so any login shell passes it through as it is.
VERIFIED = ('import hashlib,os,stat,sys;p=sys.argv[1];u=os.getuid();d=os.path.dirname(p);'
            'ok=os.path.isdir(d) and not os.path.islink(d) and os.path.isfile(p) and not os.path.islink(p);'
            'f=ok and os.open(p,os.O_RDONLY|os.O_NOFOLLOW);b=ok and os.read(f,1<<24);s=ok and os.fstat(f);'
            'mine=lambda x:x.st_uid==u and not x.st_mode&18;'
            'ok=ok and mine(os.lstat(d)) and mine(s) and hashlib.sha256(b).hexdigest()==sys.argv[2];'
            'ok or (print("' + MISSING + '"),sys.exit(0));'
            'sys.argv=[p]+sys.argv[3:];' + RUN)


def _invocation(node, command: str, args: tuple[str, ...]) -> str:
    # -S: runctl needs only the standard library; skipping site-packages (.pth hooks, editable installs) makes
    # each call ~60 ms cheaper on the node, and a launch makes several calls per node.
    return " ".join([quote_path(node.python), "-S", "-c", shlex.quote(VERIFIED), quote_path(agent_path(node.workdir)),
                     _runctl()[2], shlex.quote(command), *_quoted(args)])


def _quoted(args: tuple[str, ...]) -> list[str]:
    return [quote_path(a) if a.startswith("~") else shlex.quote(a) for a in args]


def _answer(node, command: str, result):
    """runctl's answer (after any login banner) as its type (nodectl/remote/answers.py), or the reason there is
    none: AgentError when runctl said why it could not, AnswerError when the answer is not what `command`
    answers."""
    answer = last_json(result.stdout)
    if answer is None:
        what = f"runctl {command}"
        raise AgentError(explain_failure(node, f"`{what}`", result), kind=NodeErrorKind.EXITED, command=what,
                         exit_code=result.exit_code, last_lines=_printable(result.tail(8)))
    return _typed(node, command, answer, result.exit_code)


def _typed(node, command: str, answer: dict, exit_code: int | None = None):
    """One JSON answer of runctl's as `command`'s type, or the error it carries."""
    what = f"runctl {command}"
    if answer.get("unsafe"):
        raise unsafe_error(node, answer)
    if answer.get("error"):
        error = NoRun if answer.get("no_run") is True else AgentError
        raise error(f"{node.name}: {_printable(answer['error'])}", command=what, exit_code=exit_code)
    try:
        return answers.parse(command, answer)
    except answers.AnswerError as exc:
        raise AgentError(f"{node.name} answered `{what}` malformed: {exc}", kind=NodeErrorKind.MALFORMED, command=what,
                         exit_code=exit_code) from None


def _printable(text) -> str:
    """A node's own words, cut to a few lines' worth, with a terminal's escapes made visible."""
    return visible(str(text)[:2000], colour=False)


# The node-side trust rule (runctl/common.py's `trusted_workdir` and `own_folder`) for the one folder runctl is installed
# in, before anything is written or run there: the workdir is the login user's or root's (and sticky where others
# may write), <workdir>/.nodectl is a folder of the login user's, made 0700, not a link. Otherwise one JSON line
# {"unsafe": {...}} and nothing else happens (a `.nodectl` another user planted as a link to /etc is never chmod-ed
# or written through). The path to the workdir is judged first as runctl's `resolve_workdir` judges it (OpenSSH's
# StrictModes: every folder and link on it root's or yours; a folder others can write, sticky), so a workdir that is
# another user's link (to /etc) is refused before anything is made through it. One line, no backslash, no single
# quote: the walk is exec-ed from lines joined with chr(10).
_WALK = (
    "def K(w, u):",
    ' q = [x for x in w.split("/") if x not in (".", "")]; c = "/"; h = 0',
    " while q:",
    "  n = q.pop(0)",
    '  if n == "..":',
    "   c = os.path.dirname(c); continue",
    "  P = os.path.join(c, n)",
    "  try:",
    "   s = os.lstat(P)",
    "  except FileNotFoundError:",
    "   return",
    "  L = stat.S_ISLNK(s.st_mode)",
    '  r(s.st_uid not in (u, 0) and [P, (L and "a symbolic link (to %s)" % os.readlink(P) or "a folder") + " owned '
    'by uid %d, not by you (uid %d) or root: whoever owns it chooses where nodectl writes; use a workdir of your own '
    '(e.g. mkdir -m 700 %s/$USER)" % (s.st_uid, u, c.rstrip("/"))])',
    "  h += L",
    '  r(h > 40 and [w, "a loop of symbolic links"])',
    "  if L:",
    '   t = os.readlink(P); q[:0] = [x for x in t.split("/") if x not in (".", "")]',
    '   c = "/" if t.startswith("/") else c; continue',
    '  r(s.st_mode & 18 and not s.st_mode & 512 and q and [P, "writable by other users without the sticky bit, on '
    'the way to the workdir"])',
    "  c = P ",
)
SAFE_FOLDER = ('import os,stat,sys,json;p=sys.argv[1];d=os.path.dirname(p);w=os.path.dirname(d);u=os.getuid();'
               'r=lambda e:e and (print(json.dumps({"error":" is ".join(e),"unsafe":{"path":e[0],"why":e[1]}})),'
               'sys.exit(0));'
               'exec(chr(10).join([' + ",".join('"""' + line + ' """' for line in _WALK) + ']));'
               'K(w,u);os.makedirs(w,0o700,exist_ok=True);W=os.stat(w);'
               'r(W.st_uid not in (u,0) and [w,"owned by uid %d, not by you (uid %d) or root" % (W.st_uid,u)] or '
               'W.st_mode&18 and not W.st_mode&512 and [w,"writable by other users without the sticky bit"]);'
               'os.path.lexists(d) or os.mkdir(d,0o700);s=os.lstat(d);'
               'r(stat.S_ISLNK(s.st_mode) and [d,"a symbolic link (to %s), not a folder nodectl made" % os.readlink(d)] '
               'or not stat.S_ISDIR(s.st_mode) and [d,"not a folder"] '
               'or s.st_uid!=u and [d,"owned by uid %d, not by you (uid %d): another user made it first" % (s.st_uid,u)]);'
               'os.chmod(d,0o700);')

# Installs runctl (the artifact comes first on stdin, N bytes) unless the file there holds exactly those bytes,
# then runs it in the same process: the first call to a node is one round trip whether runctl was there or not.
BOOTSTRAP = SAFE_FOLDER + (
    'b=sys.stdin.buffer.read(int(sys.argv[2]));t=p+".tmp%d"%os.getpid();'
    'os.path.isfile(p) and not os.path.islink(p) and open(p,"rb").read()==b or '
    '(f:=open(t,"wb"),f.write(b),f.close(),os.chmod(t,0o600),os.replace(t,p));'
    'sys.argv=[p]+sys.argv[3:];' + RUN)
# Installs runctl anew (the file was missing, or failed VERIFIED's check), under the same rule.
INSTALL = SAFE_FOLDER + ('b=sys.stdin.buffer.read();t=p+".tmp%d"%os.getpid();f=open(t,"wb");f.write(b);f.close();'
                         'os.chmod(t,0o600);os.replace(t,p);print(json.dumps({"installed":p}))')


def call(transport: Transport, command: str, *args: str, request: dict | None = None,
         timeout: float = AGENT_TIMEOUT):
    """Run one runctl subcommand on the node, installing runctl first if this version is not there yet."""
    node = transport.node
    path = agent_path(node.workdir)
    body = json.dumps(request or {})
    if not transport.runctl_seen:  # first call on this connection: install on the way
        source = _runctl()[0]
        bootstrap = " ".join([quote_path(node.python), "-S", "-c", shlex.quote(BOOTSTRAP), quote_path(path),
                              str(len(source)), shlex.quote(command), *_quoted(args)])
        with _named(node, command, timeout):
            result = transport.run(bootstrap, stdin=source + body.encode(), timeout=timeout)
        answer = _answer(node, command, result)
        transport.runctl_seen = True
        return answer
    invocation = _invocation(node, command, args)
    # Usually one round trip. Only when this version of runctl is gone from the node or fails its check (the
    # marker comes back; a login banner may come with it) does a second command install it from stdin, and a third
    # repeat the call.
    with _named(node, command, timeout):
        result = transport.run(invocation, stdin=body, timeout=timeout)
        if MISSING in result.stdout.splitlines():
            _install(transport, path, timeout)
            result = transport.run(invocation, stdin=body, timeout=timeout)
    return _answer(node, command, result)


def call_stream(transport: Transport, command: str, *args: str, produce, request: dict | None = None,
                timeout: float = AGENT_TIMEOUT):
    """Like `call`, for a subcommand that reads a stream: `produce(sink)` writes it after the request (which
    travels first, its length on a line of its own). runctl must be installed already (any earlier `call`
    installs it)."""
    body = json.dumps(request or {}).encode()

    def framed(sink) -> None:
        sink.write(b"%d\n" % len(body) + body)
        produce(sink)

    with _named(transport.node, command, timeout):
        result = transport.run_stream(_invocation(transport.node, command, args), framed, timeout=timeout)
    return _answer(transport.node, command, result)


@contextmanager
def _named(node, command: str, timeout: float):
    """A time-out said with the node and the verb, never the command line (a 2,000-character bootstrap)."""
    try:
        yield
    except CommandTimeout:
        raise CommandTimeout(f"{node.name}: {command} did not finish in {timeout:g} s") from None


class Watching:
    """A node's watcher of a run (runctl watch), started once over the node's connection and read a line at a
    time: each line is that node's PollAnswer. `ask` sends it a request line (what to read from now on)."""

    def __init__(self, transport: Transport, run_dir: str, request: dict) -> None:
        self.transport, self.run_dir, self.request = transport, run_dir, request
        self.lines = self._start()

    def _start(self) -> LineStream:
        body = json.dumps(self.request).encode()
        return self.transport.open_lines(_invocation(self.transport.node, "watch", (self.run_dir,)),
                                         b"%d\n" % len(body) + body)

    def next(self, timeout: float) -> answers.PollAnswer | None:
        """The next state line within `timeout` (None: none yet, or a line that is not one: a login banner).
        EOFError once the stream is gone; AgentError (NoRun) when the node answered with an error."""
        line = self.lines.readline(timeout)
        if line is None:
            return None
        if line.strip() == MISSING.encode():   # this version's runctl is not there (a node wiped meanwhile)
            self.lines.close()
            _install(self.transport, agent_path(self.transport.node.workdir), AGENT_TIMEOUT)
            self.lines = self._start()
            return None
        try:
            raw = json.loads(line)
        except (ValueError, RecursionError):
            return None
        if not isinstance(raw, dict):
            return None
        if "ended" in raw and "now" not in raw:
            raise EOFError(f"the node's watcher ended: {_printable(raw['ended'])}")
        return _typed(self.transport.node, "poll", raw)

    def ask(self, update: dict) -> None:
        self.lines.send(json.dumps(update).encode() + b"\n")

    def close(self) -> None:
        self.lines.close()

    def __enter__(self) -> "Watching":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _install(transport: Transport, path: str, timeout: float) -> None:
    node = transport.node
    command = " ".join([quote_path(node.python), "-S", "-c", shlex.quote(INSTALL), quote_path(path)])
    installed = transport.run(command, stdin=_runctl()[0], timeout=timeout)
    answer = last_json(installed.stdout)
    if answer and answer.get("unsafe"):
        raise unsafe_error(node, answer)
    if not installed.ok or not answer or "installed" not in answer:
        raise AgentError(explain_failure(node, "installing runctl", installed), kind=NodeErrorKind.EXITED,
                         command="installing runctl", exit_code=installed.exit_code,
                         last_lines=_printable(installed.tail(8)))


def unsafe_error(node, answer: dict) -> AgentError:
    """A folder the node-side trust rule refused, with the fix (exit 2: the inventory names an unsafe place)."""
    unsafe = answer.get("unsafe") if isinstance(answer.get("unsafe"), dict) else {}
    path, why = _printable(unsafe.get("path", "?")), _printable(unsafe.get("why", answer.get("error", "")))
    return AgentError(f"{node.name}: refusing to use {path}: it is {why}. nodectl keeps its files only in folders "
                      f"the login user owns (mode 0700, no links), under a workdir that is that user's or root's (and "
                      f"sticky where others may write). Remove {path} if it is not yours, or set workdir: in the "
                      f"inventory to a folder of your own", kind=NodeErrorKind.UNSAFE)


def classify_failure(node, what: str, result) -> tuple[str, str]:
    """(what is wrong, the message) for a node-side helper that did not answer: a missing interpreter, a
    workdir that cannot be written, a full disk; otherwise the exit code and last lines."""
    text = result.tail(8)
    if result.exit_code == 127 or (node.python in text and "not found" in text.lower()):
        return "python", (f"{node.name}: python {node.python!r} was not found on the node; set python: in the "
                          f"inventory to an interpreter that exists there (which python3 on the node)")
    if "Permission denied" in text or "Read-only file system" in text:
        who = f"the user {node.user}" if node.user else "the login user"
        return "workdir", (f"{node.name}: workdir {node.workdir!r} cannot be written "
                           f"({text.splitlines()[-1].strip()}); set workdir: in the inventory to a folder "
                           f"{who} can write")
    if "No space left" in text:
        return "disk", f"{node.name}: the disk under {node.workdir!r} is full"
    return "probe", f"{node.name}: {what} exited {result.exit_code}: {text or 'no output'}"


def explain_failure(node, what: str, result) -> str:
    return classify_failure(node, what, result)[1]

"""The kernels of the notebooks this suite executes (nbval's chapters, nbgrader's autograde), forked
from a process that has imported torch, ipykernel and the course once.

jupyter_client starts a kernel as a program, the kernelspec's ``argv``; the suite's kernelspec
(:func:`install`, a ``python3`` kernel found first on ``JUPYTER_PATH``) makes that program this
file. It connects to the zygote of this test worker (``--serve``, started by tests/conftest.py),
hands over its standard streams, working folder, environment and arguments, and the zygote forks a
child that becomes an ordinary ipykernel (``IPKernelApp``, as ``python -m ipykernel_launcher``
runs it). The program then stands for the kernel: it passes on the signals jupyter_client sends
(interrupt, terminate) and exits with the kernel's exit code; if it is killed, the kernel ends too.
Where no zygote answers, it becomes ``python -m ipykernel_launcher`` itself (``exec``).

Why: a notebook's first cell imports torch (1.2 s of CPU here with bytecode), and the suite starts
about 55 kernels on a machine of 2 cores. What differs from a kernel started afresh: its modules
(``PRELOAD``) were imported before its environment was set, and its parent is the zygote.
"""
from __future__ import annotations

import array
import atexit
import json
import os
import select
import signal
import socket
import struct
import sys

SOCKET_ENV = "INTRALAYER_KERNEL_ZYGOTE"
#: Imported once by the zygote; not matplotlib, whose backend a kernel chooses when it starts.
PRELOAD = ("torch", "torch.distributed", "ipykernel.kernelapp", "ipykernel.ipkernel", "intralayer.labs")
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


def install(folder: str) -> None:
    """Write the kernelspec under ``folder``/kernels/python3; put ``folder`` first on JUPYTER_PATH."""
    spec = os.path.join(folder, "kernels", "python3")
    os.makedirs(spec, exist_ok=True)
    with open(os.path.join(spec, "kernel.json"), "w") as f:
        json.dump({"argv": [sys.executable, os.path.abspath(__file__), "-f", "{connection_file}"],
                   "display_name": "Python 3 (ipykernel)", "language": "python",
                   "metadata": {"debugger": True}}, f)


def _exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError("the other side closed the connection")
        data += chunk
    return data


def serve(path: str) -> None:
    """The zygote: import PRELOAD, then fork a kernel for each client; end when stdin closes (the
    test worker that started it has ended)."""
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)                                     # clients may connect now; they wait for accept
    listener.listen(64)
    for module in PRELOAD:
        __import__(module)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)          # the kernels are reaped by the system
    while True:
        ready, _, _ = select.select([listener, sys.stdin], [], [])
        if sys.stdin in ready:
            return
        conn, _ = listener.accept()
        try:
            fds = array.array("i")
            msg, ancdata, _, _ = conn.recvmsg(4, socket.CMSG_LEN(3 * fds.itemsize))
            for level, kind, data in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
            size = struct.unpack("!I", msg + _exactly(conn, 4 - len(msg)))[0]
            request = json.loads(_exactly(conn, size))
        except (OSError, EOFError, ValueError):
            conn.close()
            continue
        pid = os.fork()
        if pid == 0:
            listener.close()
            _kernel(conn, list(fds), request)               # never returns
        for fd in fds:
            os.close(fd)
        conn.close()


def _kernel(conn: socket.socket, fds: list[int], request: dict) -> None:
    """In the forked child: become the client's kernel, and end with it."""
    code = 1
    try:
        conn.sendall(struct.pack("!i", os.getpid()))        # first the kernel's pid, last its exit code
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.setpgrp()                                        # signals to the kernel reach its group
        for target, fd in zip((0, 1, 2), fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        del sys.path[0]                                     # as ipykernel_launcher does; IPython adds '' back
        # IPKernelApp reads JPY_PARENT_PID when it is imported (here: in the zygote); it polls that parent
        args = [*request["args"], f"--IPKernelApp.parent_handle={int(os.environ.get('JPY_PARENT_PID') or 0)}"]
        sys.argv = ["ipykernel_launcher", *args]
        import threading

        def watch() -> None:                                # the client gone (killed): end the kernel
            try:
                while conn.recv(1):
                    pass
            finally:
                os._exit(1)
        threading.Thread(target=watch, daemon=True).start()
        from ipykernel import kernelapp
        try:
            kernelapp.launch_new_instance(argv=args)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:                               # noqa: BLE001 (a closed stream at exit)
                pass
        try:
            conn.sendall(bytes([code & 0xFF]))
        except OSError:
            pass
        os._exit(code)


def client(args: list[str]) -> None:
    """The kernelspec's program: have the zygote fork the kernel, stand for it until it exits."""
    path = os.environ.get(SOCKET_ENV)
    sock = socket.socket(socket.AF_UNIX)
    try:
        if not path:
            raise OSError("no zygote")
        sock.connect(path)
        body = json.dumps({"args": args, "cwd": os.getcwd(), "env": dict(os.environ)}).encode()
        header = struct.pack("!I", len(body))
        sock.sendmsg([header], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [0, 1, 2]))])
        sock.sendall(body)
        pid = struct.unpack("!i", _exactly(sock, 4))[0]
    except (OSError, EOFError):
        sock.close()
        os.execv(sys.executable, [sys.executable, "-m", "ipykernel_launcher", *args])

    def forward(signum, _frame):
        try:
            os.killpg(pid, signum)
        except ProcessLookupError:
            pass
    for signum in FORWARDED:
        signal.signal(signum, forward)
    code = b""
    while True:
        try:
            code = sock.recv(1)
            break
        except InterruptedError:
            continue
    sys.exit(code[0] if code else 1)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve(sys.argv[2])
    else:
        client(sys.argv[1:])

"""Several hosts: the leader's device calls, run again by every follower.

With jax.distributed every process's devices form one mesh, and every process must then run the
same programs, in the same order, on the same host inputs (a program with a collective waits for
all of them). Process 0's worker, the leader (the one behind the HTTP server), decides every call;
before it runs one it sends the call's name and host arguments to the other processes' workers, the
followers, and each follower runs the same Engine method with them (engine.worker.device_call).

    Leader(settings, hello)     process 0: listen, say where in jax.distributed's key-value store,
                                take every follower's connection and send each `hello`
    leader.send(name, args)     one call to every follower; leader.close() tells them to stop
    Follower(settings)          process i > 0: connect; .hello is what the leader sent
    follower.calls()            the leader's calls, in order, until it stops

One TCP connection per follower, frames of a pickled (name, args). A follower shows it belongs to
the group with a token the leader put in the key-value store (the coordinator is the one party both
already trust); only followers unpickle, and only what the leader sent.

A side that loses the other ends its process at once (LOST_EXIT_CODE, after `on_lost` has said
why): a process waiting in a collective for a dead peer could otherwise wait forever.
"""
from __future__ import annotations

import os
import pickle
import queue
import secrets
import socket
import struct
import sys
import threading

# Where the leader says how to reach it, in jax.distributed's key-value store.
ADDRESS_KEY = "mashbox/mirror"
# How long the leader waits for every follower to connect, and a follower for the leader's address:
# both run after jax.distributed.initialize, which has already waited for every process.
CONNECT_TIMEOUT_S = 120.0
# Exit status of a worker whose peer went away: distinct from a crash's 1 and a fault's 70.
LOST_EXIT_CODE = 71
_FRAME = struct.Struct("!Q")
_STOP = None                     # the name of the last frame: the leader is done


def _client():
    from jax._src import distributed    # the key-value store has no public name
    return distributed.global_state.client


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(min(n - len(data), 1 << 20))
        if not chunk:
            raise EOFError("connection closed")
        data += chunk
    return bytes(data)


def _frame(obj) -> bytes:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return _FRAME.pack(len(data)) + data


def exit_lost(why: str) -> None:
    print(f"mashbox: {why}", file=sys.stderr, flush=True)
    os._exit(LOST_EXIT_CODE)


class Leader:
    def __init__(self, settings: tuple[str, int, int], hello, on_lost=exit_lost):
        _, processes, _ = settings
        token = secrets.token_hex(16)
        # every interface (followers are on other hosts), IPv6 too where the coordinator may be named so
        dual = socket.has_dualstack_ipv6()
        listener = socket.create_server(("", 0), family=socket.AF_INET6 if dual else socket.AF_INET,
                                        dualstack_ipv6=dual)
        listener.settimeout(CONNECT_TIMEOUT_S)
        _client().key_value_set(ADDRESS_KEY, f"{listener.getsockname()[1]} {token}")
        self.followers: dict[int, socket.socket] = {}
        self.closing = False
        with listener:
            while len(self.followers) < processes - 1:
                try:
                    sock, _ = listener.accept()
                except socket.timeout:
                    raise TimeoutError(f"{processes - 1 - len(self.followers)} follower(s) did not connect "
                                       f"within {CONNECT_TIMEOUT_S:g} s") from None
                sock.settimeout(CONNECT_TIMEOUT_S)
                try:
                    line = _recv_exact(sock, 32 + 9).decode()       # token, then the process id
                    if line[:32] != token:
                        raise ValueError("wrong token")
                    index = int(line[32:])
                except (OSError, EOFError, ValueError, UnicodeDecodeError):
                    sock.close()              # not one of the group: it gets nothing
                    continue
                sock.settimeout(None)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.sendall(_frame(hello))
                self.followers[index] = sock
        for index, sock in self.followers.items():
            threading.Thread(target=self._watch, args=(index, sock, on_lost), daemon=True,
                             name=f"mirror-watch-{index}").start()

    def _watch(self, index: int, sock: socket.socket, on_lost) -> None:
        """A follower sends nothing after its hello: anything that ends this read means it is gone."""
        try:
            sock.recv(1)
        except OSError:
            pass
        if not self.closing:
            on_lost(f"follower process {index} disconnected: the mesh is broken, this worker exits")

    def send(self, name: str | None, args: tuple = ()) -> None:
        frame = _frame((name, args))
        for index, sock in self.followers.items():
            try:
                sock.sendall(frame)
            except OSError as e:
                raise ConnectionError(f"follower process {index} is gone ({e})") from None

    def close(self) -> None:
        """Tell the followers to stop (their workers then exit cleanly), and let go of them."""
        self.closing = True
        try:
            self.send(_STOP)
        except ConnectionError:
            pass
        for sock in self.followers.values():
            sock.close()


class Follower:
    def __init__(self, settings: tuple[str, int, int], on_lost=exit_lost):
        coordinator, _, index = settings
        port, token = _client().blocking_key_value_get(ADDRESS_KEY, int(CONNECT_TIMEOUT_S * 1000)).split()
        host = coordinator.rsplit(":", 1)[0].strip("[]")
        self.sock = socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S)
        self.sock.sendall(f"{token}{index:9d}".encode())
        self.hello = self._read()
        self.sock.settimeout(None)
        self._calls: queue.Queue = queue.Queue()
        threading.Thread(target=self._reader, args=(on_lost,), daemon=True, name="mirror-reader").start()

    def _read(self):
        size, = _FRAME.unpack(_recv_exact(self.sock, _FRAME.size))
        return pickle.loads(_recv_exact(self.sock, size))

    def _reader(self, on_lost) -> None:
        """Reads ahead of the calls being run, so a leader that is gone is noticed even while this
        process waits in a collective for it."""
        while True:
            try:
                call = self._read()
            except (OSError, EOFError) as e:
                on_lost(f"the leader (process 0) is gone ({e}): this follower's worker exits")
                return
            self._calls.put(call)
            if call[0] is _STOP:
                return

    def calls(self):
        """(name, args) of every call the leader makes, in order, until it stops."""
        while True:
            name, args = self._calls.get()
            if name is _STOP:
                self.sock.close()
                return
            yield name, args

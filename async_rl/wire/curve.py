"""ZeroMQ CURVE authentication and encryption for the hub and experience sockets.

`async-rl keys DIR` writes one key pair for the hub (server) and one for actors
(client), in pyzmq's certificate format:

    DIR/server.key  DIR/server.key_secret      the hub's public / secret key
    DIR/client.key  DIR/client.key_secret      the actors' public / secret key
    DIR/authorized/client.key                  public keys the hub accepts

With `security.curve=true` the hub's sockets are CURVE servers and a ZAP handler
(pyzmq's ThreadAuthenticator) admits only clients whose public key is in
DIR/authorized: a peer without CURVE, or with any other key, never completes the
handshake, so not one of its messages reaches our code. Actors need the secret
client key and the hub's public key (`async-rl actor --keys DIR`). Copy the whole
directory to actor machines; add more actor identities by dropping their public
keys into DIR/authorized.

The torch.distributed store and the weight broadcast are not covered: they carry no
commands, but on a shared network keep their ports behind a firewall.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

AUTHORIZED = "authorized"


def make_keys(directory: str | Path) -> Path:
    """Create the server and client key pairs; refuse to overwrite existing keys."""
    d = Path(directory)
    if (d / "server.key_secret").exists() or (d / "client.key_secret").exists():
        raise FileExistsError(f"{d}: keys already exist; remove them first to make new ones")
    d.mkdir(parents=True, exist_ok=True)
    zmq.auth.create_certificates(d, "server")
    zmq.auth.create_certificates(d, "client")
    (d / AUTHORIZED).mkdir(exist_ok=True)
    shutil.copy(d / "client.key", d / AUTHORIZED / "client.key")
    for secret in d.glob("*.key_secret"):
        secret.chmod(0o600)
    return d


def _load(path: Path) -> tuple[bytes, bytes | None]:
    if not path.exists():
        raise FileNotFoundError(f"{path}: missing CURVE key (make keys with `async-rl keys DIR`)")
    return zmq.auth.load_certificate(path)


class CurveServer:
    """Makes sockets CURVE servers and runs the ZAP handler that checks client keys."""

    def __init__(self, ctx: zmq.Context, keys_dir: str | Path):
        d = Path(keys_dir)
        self.public, self.secret = _load(d / "server.key_secret")
        if not (d / AUTHORIZED).is_dir():
            raise FileNotFoundError(f"{d / AUTHORIZED}: missing directory of authorized client keys")
        self.auth = ThreadAuthenticator(ctx)
        self.auth.start()
        self.auth.configure_curve(domain="*", location=str(d / AUTHORIZED))

    def secure(self, sock: zmq.Socket) -> zmq.Socket:
        """Call before bind."""
        sock.curve_server = True
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret
        return sock

    def stop(self) -> None:
        self.auth.stop()


def secure_client(sock: zmq.Socket, keys_dir: str | Path) -> zmq.Socket:
    """Make `sock` a CURVE client of the hub; call before connect."""
    d = Path(keys_dir)
    public, secret = _load(d / "client.key_secret")
    server_public, _ = _load(d / "server.key")
    sock.curve_publickey = public
    sock.curve_secretkey = secret
    sock.curve_serverkey = server_public
    return sock

"""``dsv4lab lab``: JupyterLab on the notebooks, with the project's kernel registered.

    dsv4lab lab [--port 8888] [--token TOKEN] [--browser] [--notebook-dir notebooks]

It registers a kernel named ``dsv4lab`` for this Python (ipykernel's API, the same as
``python -m ipykernel install --user --name dsv4lab``), then starts JupyterLab on
127.0.0.1 only, prints the URL with its token, and waits until JupyterLab exits
(Ctrl-C). No browser is opened unless ``--browser`` is given. Explained in
notebooks/00_tour.ipynb.
"""
from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = REPO_ROOT / "notebooks"
KERNEL_NAME = "dsv4lab"
HOST = "127.0.0.1"


def register_kernel(*, user: bool = True, prefix: str | None = None) -> str:
    """Install the ``dsv4lab`` kernelspec for this Python; returns where it went."""
    from ipykernel.kernelspec import install

    return install(user=user if prefix is None else False, prefix=prefix, kernel_name=KERNEL_NAME,
                   display_name="Python (dsv4lab)")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def url(port: int, token: str, path: str = "lab") -> str:
    return f"http://{HOST}:{port}/{path}?token={token}"


def server_command(port: int, token: str, root_dir: str | Path = NOTEBOOKS, *,
                   open_browser: bool = False, default_kernel: str | None = None) -> list[str]:
    """The command that starts JupyterLab on loopback at ``port`` with ``token``."""
    cmd = [sys.executable, "-m", "jupyterlab",
           f"--ServerApp.ip={HOST}", f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
           f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={Path(root_dir).resolve()}",
           "--ServerApp.open_browser=" + ("True" if open_browser else "False"),
           "--LabApp.news_url=", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--ServerApp.allow_root=True")     # containers and CI run as root
    if default_kernel:
        cmd.append(f"--MappingKernelManager.default_kernel_name={default_kernel}")
    return cmd


def start(root: str | Path = NOTEBOOKS, *, port: int = 8888, token: str | None = None,
          browser: bool = False, install_kernel: bool = True, dry_run: bool = False) -> int:
    """Register the kernel (unless ``install_kernel`` is False), start JupyterLab on ``root``
    at 127.0.0.1:``port`` (0: a free port) and wait until it exits; returns its exit status.
    ``dry_run``: print the URL and the command, start nothing. (``dsv4lab lab`` parses the
    flags: :mod:`dsv4lab.cli`.)"""
    root = Path(root)
    port = port or free_port()
    token = token or secrets.token_hex(16)
    cmd = server_command(port, token, root, open_browser=browser)
    if dry_run:
        print(url(port, token))
        print(" ".join(cmd))
        return 0
    if install_kernel:
        where = register_kernel()
        print(f"kernel '{KERNEL_NAME}' registered in {where}")
    print(f"JupyterLab on {root.resolve()}\n  open: {url(port, token)}\n(Ctrl-C stops it)", flush=True)
    proc = subprocess.Popen(cmd)
    # a SIGTERM to this process stops JupyterLab too (it shuts its kernels down)
    signal.signal(signal.SIGTERM, lambda *_: proc.terminate())
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        try:
            return proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()

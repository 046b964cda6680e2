"""A real terminal for the view tests: tmux on a private socket."""

from __future__ import annotations

import subprocess
import uuid


class Tmux:
    """One tmux server of our own (``tmux -L <unique>``) with one 120x40 pane."""

    def __init__(self) -> None:
        self.cmd = ["tmux", "-L", f"et-view-{uuid.uuid4().hex[:8]}"]

    def start(self, command: str) -> None:
        """Run the shell ``command`` in a new session's pane."""
        subprocess.run([*self.cmd, "new-session", "-d", "-x", "120", "-y", "40", command],
                       check=True)

    def pane(self) -> str:
        """What the pane shows, with 60 lines of scrollback."""
        return subprocess.run([*self.cmd, "capture-pane", "-p", "-S", "-60"],
                              capture_output=True, text=True, check=False).stdout

    def kill(self) -> None:
        """Stop the server and what runs in it."""
        subprocess.run([*self.cmd, "kill-server"], capture_output=True, check=False)

    def keys(self, *keys: str) -> None:
        subprocess.run([*self.cmd, "send-keys", *keys], check=True)

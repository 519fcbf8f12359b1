"""Running the real `tinker` CLI (the SDK's console script) against a test server, and a local
stand-in for the Hugging Face Hub upload API (the real upload needs a network these tests do not have)."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def run_cli(server_url: str, key: str, *args: str, cwd=None, env: dict | None = None, check: bool = True):
    """`tinker ARGS` in a subprocess, pointed at the server by TINKER_BASE_URL / TINKER_API_KEY."""
    full_env = {
        **os.environ,
        "TINKER_BASE_URL": server_url,
        "TINKER_API_KEY": key,
        "TINKER_TELEMETRY": "0",
        **(env or {}),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "tinker.cli", *args], capture_output=True, text=True, cwd=cwd, env=full_env, timeout=300
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"tinker {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


def run_cli_json(server_url: str, key: str, *args: str, **kw):
    return json.loads(run_cli(server_url, key, "--format", "json", *args, **kw).stdout)


class HubStandIn:
    """The Hub endpoints `HfApi.whoami / create_repo / hf_hub_download / upload_folder` call, on 127.0.0.1.

    Every file goes up in "regular" mode (inline in the commit), so the committed bytes are kept here
    for the test to compare."""

    def __init__(self):
        self.requests: list[tuple[str, str]] = []
        self.repos: list[dict] = []
        self.files: dict[str, bytes] = {}
        self.commits: list[dict] = []
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _json(self, status, body):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _body(self) -> bytes:
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _no_entry(self):  # what the Hub answers for a file the repo does not have
                self.send_response(404)
                self.send_header("X-Error-Code", "EntryNotFound")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_HEAD(self):
                stand_in.requests.append(("HEAD", self.path))
                self._no_entry()

            def do_GET(self):
                stand_in.requests.append(("GET", self.path))
                if self.path.startswith("/api/whoami-v2"):
                    return self._json(
                        200,
                        {
                            "type": "user",
                            "name": "standin",
                            "fullname": "Stand In",
                            "orgs": [],
                            "auth": {"type": "access_token", "accessToken": {"displayName": "t", "role": "write"}},
                        },
                    )
                self._no_entry()

            def do_POST(self):
                stand_in.requests.append(("POST", self.path))
                body = self._body()
                if self.path == "/api/repos/create":
                    info = json.loads(body)
                    stand_in.repos.append(info)
                    name = f"{info.get('organization') or 'standin'}/{info['name']}"
                    return self._json(200, {"url": f"{stand_in.url}/{name}", "name": name})
                if self.path == "/api/validate-yaml":  # the model card's metadata block
                    return self._json(200, {"errors": [], "warnings": []})
                if "/preupload/" in self.path:
                    files = json.loads(body)["files"]
                    return self._json(
                        200,
                        {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]},
                    )
                if "/commit/" in self.path:
                    lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
                    stand_in.commits.append({"path": self.path, "lines": lines})
                    for line in lines:
                        if line["key"] == "file":
                            stand_in.files[line["value"]["path"]] = base64.b64decode(line["value"]["content"])
                    return self._json(
                        200,
                        {
                            "commitUrl": f"{stand_in.url}/standin/adapter/commit/{'0' * 40}",
                            "commitOid": "0" * 40,
                            "commitMessage": "upload",
                            "pullRequestUrl": None,
                        },
                    )
                return self._json(404, {"error": f"stand-in has no {self.path}"})

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()

    def close(self):
        self._httpd.shutdown()

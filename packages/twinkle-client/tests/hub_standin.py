"""Local STAND-INs for the Hugging Face Hub's and ModelScope's upload APIs, on 127.0.0.1 (these
machines reach no hub). ModelScope's (`ModelScopeStandIn`) is described at its class.

It speaks just the part of the real protocol that `huggingface_hub.HfApi.create_repo` and
`upload_folder` use when Xet storage is off (HF_HUB_DISABLE_XET=1), as read from huggingface_hub's
source (hf_api.create_repo, _commit_api._fetch_upload_modes / _send_commit, lfs.post_lfs_batch_info /
lfs_upload):
  POST /api/repos/create                              {"name", "organization", "type"} -> {"url"}; 409 if it exists
  POST /api/{type}s/{repo}/preupload/{rev}            {"files": [{path, sample, size}]} -> upload mode per file
  POST /{repo}.git/info/lfs/objects/batch             LFS batch: where to PUT each "lfs" file
  PUT  /lfs-upload/{oid}                              the LFS file's bytes (sha256 checked)
  POST /api/{type}s/{repo}/commit/{rev}               ndjson: header, then "file" (base64) / "lfsFile" (oid)
Every request must carry `Authorization: Bearer <token>`. `.safetensors` files go the LFS way, as on
the real hub; everything else inline in the commit. What a commit stored is in `repos[repo_id]`.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TOKEN = "hf_standin_token"


class HubStandIn:
    token = TOKEN

    def __init__(self):
        self.repos: dict[str, dict[str, bytes]] = {}  # repo id -> path -> committed bytes
        self.blobs: dict[str, bytes] = {}  # LFS oid -> bytes
        self.requests: list[str] = []  # "METHOD path" in order
        self.lfs_paths: list[str] = []
        handler = type("Handler", (self._handler(),), {"hub": self})
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @staticmethod
    def _handler() -> type[BaseHTTPRequestHandler]:
        return _Handler

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


class _Handler(BaseHTTPRequestHandler):
    hub: HubStandIn

    def log_message(self, *args):  # quiet
        pass

    def _reply(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> bytes:
        return self.rfile.read(int(self.headers.get("Content-Length", 0)))

    def _authorized(self) -> bool:
        if self.headers.get("Authorization") == f"Bearer {self.hub.token}":
            return True
        self._reply(401, {"error": "Invalid credentials in Authorization header"})
        return False

    def do_PUT(self):
        self.hub.requests.append(f"PUT {self.path}")
        body = self._body()
        match = re.fullmatch(r"/lfs-upload/([0-9a-f]{64})", self.path)
        if not match or hashlib.sha256(body).hexdigest() != match[1]:
            return self._reply(400, {"error": "sha256 mismatch"})
        self.hub.blobs[match[1]] = body
        self._reply(200, {})

    def do_POST(self):
        self.hub.requests.append(f"POST {self.path.split('?')[0]}")
        if not self._authorized():
            return
        body, path = self._body(), self.path.split("?")[0]
        if path == "/api/repos/create":
            return self._create(json.loads(body))
        if m := re.fullmatch(r"/api/models/(.+?/.+?)/(preupload|commit)/([^/]+)", path):
            if m[1] not in self.hub.repos:
                return self._reply(404, {"error": "Repository not found"})
            return self._preupload(json.loads(body)) if m[2] == "preupload" else self._commit(m[1], body)
        if m := re.fullmatch(r"/(.+?/.+?)\.git/info/lfs/objects/batch", path):
            return self._lfs_batch(json.loads(body))
        self._reply(404, {"error": f"the stand-in does not implement {path}"})

    def _create(self, payload: dict) -> None:
        repo_id = f"{payload['organization']}/{payload['name']}"
        if payload.get("type", "model") != "model":
            return self._reply(400, {"error": "the stand-in holds model repos only"})
        url = f"{self.hub.endpoint}/{repo_id}"
        if repo_id in self.hub.repos:  # the hub's 409 carries the url too: create_repo(exist_ok=True) reads it
            return self._reply(409, {"error": "You already created this model repo", "url": url})
        self.hub.repos[repo_id] = {}
        self._reply(200, {"url": url, "name": repo_id})

    def _preupload(self, payload: dict) -> None:
        files = [
            {
                "path": f["path"],
                "uploadMode": "lfs" if f["path"].endswith(".safetensors") else "regular",
                "shouldIgnore": False,
                "oid": None,
            }
            for f in payload["files"]
        ]
        self._reply(200, {"files": files, "commitOid": "0" * 40})

    def _lfs_batch(self, payload: dict) -> None:
        objects = [
            {
                "oid": o["oid"],
                "size": o["size"],
                "actions": {"upload": {"href": f"{self.hub.endpoint}/lfs-upload/{o['oid']}"}},
            }
            for o in payload["objects"]
        ]
        self._reply(200, {"transfer": "basic", "objects": objects})

    def _commit(self, repo_id: str, body: bytes) -> None:
        lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        if not lines or lines[0]["key"] != "header":
            return self._reply(400, {"error": "a commit starts with its header"})
        files = {}
        for line in lines[1:]:
            value = line["value"]
            if line["key"] == "file":
                files[value["path"]] = base64.b64decode(value["content"])
            elif line["key"] == "lfsFile":
                if value["oid"] not in self.hub.blobs:
                    return self._reply(422, {"error": f"LFS object {value['oid']} was never uploaded"})
                files[value["path"]] = self.hub.blobs[value["oid"]]
                self.hub.lfs_paths.append(value["path"])
            else:
                return self._reply(400, {"error": f"the stand-in does not implement {line['key']}"})
        self.hub.repos[repo_id].update(files)
        oid = hashlib.sha1(body).hexdigest()
        self._reply(
            200, {"commitUrl": f"{self.hub.endpoint}/{repo_id}/commit/{oid}", "commitOid": oid, "success": True}
        )


MS_TOKEN = "ms_standin_token"


class ModelScopeStandIn(HubStandIn):
    """ModelScope's upload API as `modelscope.hub.api.HubApi.create_repo` and `upload_folder` call it
    (modelscope 1.40 delegating to modelscope_hub 0.5: modelscope_hub/_legacy_api.py create_repo,
    validate_blobs, upload_blob, create_commit), with its `{"Code", "Data", "Message", "Success"}` bodies:
      POST /api/v1/models                                  {"Path": org, "Name": name, "Visibility"} ; 409 if it exists
      POST /api/v1/repos/models/{repo}/info/lfs/objects/batch   {"objects": [{oid, size}]} -> upload href per blob
      PUT  /lfs-upload/{oid}                               the blob's bytes (sha256 checked)
      POST /api/v1/repos/models/{repo}/commit/{revision}   {"actions": [{path, type: normal|lfs, content|sha256}]}
    The client sends `Authorization: Bearer <token>` (and the token as the m_session_id cookie).
    """

    token = MS_TOKEN

    @staticmethod
    def _handler() -> type[BaseHTTPRequestHandler]:
        return _ModelScopeHandler


class _ModelScopeHandler(_Handler):
    def _reply_ms(self, status: int, data: dict | None = None, message: str = "") -> None:
        self._reply(
            status, {"Code": status, "Data": data, "Message": message, "Success": status == 200, "RequestId": "standin"}
        )

    def _authorized(self) -> bool:
        if self.headers.get("Authorization") == f"Bearer {self.hub.token}":
            return True
        self._reply_ms(401, message="Invalid access token")
        return False

    def do_POST(self):
        path = self.path.split("?")[0]
        self.hub.requests.append(f"POST {path}")
        if not self._authorized():
            return
        body = json.loads(self._body())
        if path == "/api/v1/models":
            return self._create_ms(f"{body['Path']}/{body['Name']}")
        m = re.fullmatch(r"/api/v1/repos/models/(.+?/.+?)/(info/lfs/objects/batch|commit/[^/]+)", path)
        if not m:
            return self._reply_ms(404, message=f"the stand-in does not implement {path}")
        if m[1] not in self.hub.repos:
            return self._reply_ms(404, message=f"model {m[1]} does not exist")
        return self._lfs_batch_ms(body) if m[2].startswith("info") else self._commit_ms(m[1], body)

    def _create_ms(self, repo_id: str) -> None:
        if repo_id in self.hub.repos:
            return self._reply_ms(409, message=f"model {repo_id} already exists")
        self.hub.repos[repo_id] = {}
        self._reply_ms(200, {"Path": repo_id.split("/")[0], "Name": repo_id.split("/")[1]})

    def _lfs_batch_ms(self, body: dict) -> None:
        objects = [
            {
                "oid": o["oid"],
                "size": o["size"],
                "actions": {}
                if o["oid"] in self.hub.blobs
                else {"upload": {"href": f"{self.hub.endpoint}/lfs-upload/{o['oid']}"}},
            }
            for o in body["objects"]
        ]
        self._reply_ms(200, {"objects": objects})

    def _commit_ms(self, repo_id: str, body: dict) -> None:
        files = {}
        for action in body["actions"]:
            if action["action"] not in ("create", "update"):
                return self._reply_ms(400, message=f"the stand-in does not implement {action['action']}")
            if action["type"] == "normal":
                files[action["path"]] = base64.b64decode(action["content"])
            elif action["sha256"] in self.hub.blobs:
                files[action["path"]] = self.hub.blobs[action["sha256"]]
                self.hub.lfs_paths.append(action["path"])
            else:
                return self._reply_ms(400, message=f"LFS object {action['sha256']} was never uploaded")
        self.hub.repos[repo_id].update(files)
        self._reply_ms(200, {"CommitId": hashlib.sha1(json.dumps(body).encode()).hexdigest()})

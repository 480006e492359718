"""A recording stand-in for the Kubernetes API server (not a test module): the three node calls the agent
makes, answered the way the API server does, every request recorded with its arrival time. A real API
server cannot run here; the agent's side is its real client (`lightkube`, the `sdcwatch[k8s]` extra),
unchanged.

  GET   /api/v1/nodes/<name>          the node (404 for another name)
  PATCH /api/v1/nodes/<name>/status   strategic merge patch: conditions merge by `type`
  PATCH /api/v1/nodes/<name>          merge patch of spec.taints; a metadata.resourceVersion that is not the
                                      node's current one answers 409 Conflict, as the API server does
"""

from __future__ import annotations

import copy
import dataclasses
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclasses.dataclass
class Request:
    method: str
    path: str
    content_type: str
    body: Any
    at: float  # time.monotonic() when it arrived
    authorization: str = ""


TOKEN = "sdcwatch-test-serviceaccount-token"


class FakeApiServer:
    def __init__(self, node_name: str, taints: list[dict[str, Any]] | None = None) -> None:
        self.node: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": node_name,
                "resourceVersion": "1",
                "labels": {"kubernetes.io/hostname": node_name},
            },
            "spec": {"taints": list(taints or [])},
            "status": {
                "conditions": [
                    {
                        "type": "Ready",
                        "status": "True",
                        "reason": "KubeletReady",
                        "message": "kubelet is posting ready status",
                        "lastHeartbeatTime": "2026-12-01T00:00:00Z",
                        "lastTransitionTime": "2026-12-01T00:00:00Z",
                    }
                ]
            },
        }
        self.requests: list[Request] = []
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        self.conflict_next = 0  # answer this many taint patches with 409 (a concurrent writer)
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, code: int, obj: Any) -> None:
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                server._record("GET", self.path, "", None, self.headers.get("Authorization", ""))
                code, obj = server._get(self.path)
                self._send(code, obj)

            def do_PATCH(self) -> None:
                n = int(self.headers.get("Content-Length", 0))
                body = json.loads(self.rfile.read(n) or b"null")
                ctype = self.headers.get("Content-Type", "")
                server._record("PATCH", self.path, ctype, body, self.headers.get("Authorization", ""))
                code, obj = server._patch(self.path, ctype, body)
                self._send(code, obj)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def start(self) -> FakeApiServer:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def api(self, timeout_s: float = 5.0) -> Any:
        """The agent's client (daemon.k8s_nodes.client: lightkube) pointed at this server, with a bearer
        token as a ServiceAccount's (the server records its Authorization header)."""
        import lightkube
        from lightkube.config.models import Cluster, User

        from daemon.k8s_nodes import client

        config = lightkube.KubeConfig.from_one(cluster=Cluster(server=self.url), user=User(token=TOKEN))
        return client(config, timeout_s, trust_env=False)

    # ---- state ---------------------------------------------------------------------------------------
    def _record(self, method: str, path: str, ctype: str, body: Any, auth: str) -> None:
        with self.lock:
            self.requests.append(Request(method, path, ctype, body, time.monotonic(), auth))

    def _name_ok(self, path: str, suffix: str = "") -> bool:
        return path.split("?")[0] == f"/api/v1/nodes/{self.node['metadata']['name']}{suffix}"

    def _not_found(self, path: str) -> tuple[int, Any]:
        return 404, {
            "kind": "Status",
            "apiVersion": "v1",
            "status": "Failure",
            "reason": "NotFound",
            "message": f"{path} not found",
            "code": 404,
        }

    def _get(self, path: str) -> tuple[int, Any]:
        if not self._name_ok(path):
            return self._not_found(path)
        with self.lock:
            return 200, copy.deepcopy(self.node)

    def _bump(self) -> None:
        md = self.node["metadata"]
        md["resourceVersion"] = str(int(md["resourceVersion"]) + 1)
        self.changed.notify_all()

    def _patch(self, path: str, ctype: str, body: Any) -> tuple[int, Any]:
        with self.lock:
            if self._name_ok(path, "/status"):
                if ctype != "application/strategic-merge-patch+json":
                    return 415, {"kind": "Status", "code": 415, "message": f"unexpected {ctype}"}
                conds = self.node["status"]["conditions"]
                for c in body["status"]["conditions"]:
                    old = next((x for x in conds if x["type"] == c["type"]), None)
                    if old is None:
                        conds.append(dict(c))
                    else:
                        old.update(c)
                self._bump()
                return 200, copy.deepcopy(self.node)
            if self._name_ok(path):
                if ctype != "application/merge-patch+json":
                    return 415, {"kind": "Status", "code": 415, "message": f"unexpected {ctype}"}
                rv = body.get("metadata", {}).get("resourceVersion")
                if self.conflict_next or (rv is not None and rv != self.node["metadata"]["resourceVersion"]):
                    self.conflict_next = max(0, self.conflict_next - 1)
                    return 409, {
                        "kind": "Status",
                        "apiVersion": "v1",
                        "status": "Failure",
                        "reason": "Conflict",
                        "message": "the object has been modified",
                        "code": 409,
                    }
                self.node["spec"]["taints"] = body["spec"]["taints"]
                self._bump()
                return 200, copy.deepcopy(self.node)
        return self._not_found(path)

    # ---- what tests read -----------------------------------------------------------------------------
    def condition(self, type_: str) -> dict[str, Any] | None:
        with self.lock:
            return copy.deepcopy(
                next((c for c in self.node["status"]["conditions"] if c["type"] == type_), None)
            )

    def taints(self) -> list[dict[str, Any]]:
        with self.lock:
            return copy.deepcopy(self.node["spec"]["taints"])

    def patches(self) -> list[Request]:
        with self.lock:
            return [r for r in self.requests if r.method == "PATCH"]

    def wait(self, pred: Any, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        with self.changed:
            while not pred():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.changed.wait(left)
            return True

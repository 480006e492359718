"""A recording stand-in for the Kubernetes API server (not a test module): the three node calls the agent
makes, answered the way the API server does, every request recorded with its arrival time. A real API
server cannot run here; the agent's side is its real client (`lightkube`, the `sdcwatch[k8s]` extra),
unchanged. The server speaks in the official `kubernetes` Python client's models (the `test` extra):

- what it answers (the node, a Status on errors) is built from `kubernetes.client` models (V1Node,
  V1NodeCondition, V1Taint, V1Status, ...) and serialised by `ApiClient.sanitize_for_serialization`;
- every body the agent sends is checked against those models before it is applied (`checked`): the
  models' own schema, strictly (pydantic, `extra="forbid"`, strict types: an unknown field, a number where
  a string belongs, a date-time that is not RFC 3339, a missing required field such as a condition's
  `status` or a taint's `effect` are refused with 400 and listed in `invalid`), then deserialised by the
  client's deserializer (`ApiClient.deserialize`, which alone would drop unknown fields silently);
- the node after every patch is validated as a V1Node again, so a patch cannot leave it malformed.

  GET   /api/v1/nodes/<name>          the node (404 for another name)
  PATCH /api/v1/nodes/<name>/status   strategic merge patch (application/strategic-merge-patch+json):
                                      conditions merge by `type` (their patchMergeKey), other lists are
                                      replaced; only `status` changes, as the status subresource does
  PATCH /api/v1/nodes/<name>          merge patch (application/merge-patch+json, RFC 7386: lists replaced,
                                      null deletes); `status` does not change through it
Either patch carrying a metadata.resourceVersion that is not the node's current one answers 409 Conflict,
as the API server does; every applied patch moves resourceVersion on. Another content type answers 415.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kubernetes import client as k8s

_API = k8s.ApiClient()
STRATEGIC = "application/strategic-merge-patch+json"
MERGE = "application/merge-patch+json"
# strategic merge: the lists that merge by a key (the rest are replaced), from core/v1's patchMergeKey tags
_MERGE_KEYS = {("status", "conditions"): "type", ("status", "addresses"): "type"}


class ModelError(ValueError):
    """A body the official client's models refuse."""


def checked(data: Any, model: str) -> Any:
    """`data` (parsed JSON) as the `kubernetes.client` model named `model` (e.g. "V1Node"), or ModelError:
    validated strictly by the model's schema, then deserialised by the client's deserializer."""
    text = json.dumps(data)
    try:
        getattr(k8s, model).model_validate_json(text, strict=True)
    except Exception as e:  # pydantic.ValidationError: unknown or mistyped field, a required one missing
        raise ModelError(f"not a {model}: {e}") from e
    return _API.deserialize(text, model, "application/json")


def wire(obj: Any) -> Any:
    """A model as the client serialises it (JSON-ready: camelCase names, RFC 3339 date-times)."""
    return _API.sanitize_for_serialization(obj)


def _status(code: int, reason: str, message: str) -> Any:
    return wire(
        k8s.V1Status(
            api_version="v1", kind="Status", status="Failure", reason=reason, message=message, code=code
        )
    )


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch: maps merge, null deletes, lists are replaced."""
    return strategic_merge_patch(target, patch, merge_keys={})


def strategic_merge_patch(target: Any, patch: Any, path: tuple[str, ...] = (),
                          merge_keys: dict[tuple[str, ...], str] = _MERGE_KEYS) -> Any:
    """Kubernetes' strategic merge patch for the fields the node's status uses: maps merge, null deletes,
    lists with a patchMergeKey merge by it (an entry's fields merge), other lists are replaced."""
    if isinstance(patch, list) and path in merge_keys:
        key = merge_keys[path]
        out = [dict(x) for x in (target or [])]
        for entry in patch:
            old = next((x for x in out if x.get(key) == entry.get(key)), None)
            if old is None:
                out.append(copy.deepcopy(entry))
            else:
                old.update(strategic_merge_patch(old, entry, path + ("[]",), merge_keys))
        return out
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = strategic_merge_patch(out.get(k), v, path + (k,), merge_keys)
    return out


@dataclasses.dataclass
class Request:
    method: str
    path: str
    content_type: str
    body: Any  # the JSON as sent
    at: float  # time.monotonic() when it arrived
    authorization: str = ""
    model: Any = None  # the body as a kubernetes.client.V1Node (PATCH bodies that passed `checked`)


TOKEN = "sdcwatch-test-serviceaccount-token"
_T0 = datetime.datetime(2026, 12, 1, tzinfo=datetime.timezone.utc)


class FakeApiServer:
    def __init__(self, node_name: str, taints: list[dict[str, Any]] | None = None) -> None:
        node = k8s.V1Node(
            api_version="v1",
            kind="Node",
            metadata=k8s.V1ObjectMeta(
                name=node_name, resource_version="1", labels={"kubernetes.io/hostname": node_name}
            ),
            spec=k8s.V1NodeSpec(taints=[checked(t, "V1Taint") for t in taints or []]),
            status=k8s.V1NodeStatus(
                conditions=[
                    k8s.V1NodeCondition(
                        type="Ready",
                        status="True",
                        reason="KubeletReady",
                        message="kubelet is posting ready status",
                        last_heartbeat_time=_T0,
                        last_transition_time=_T0,
                    )
                ]
            ),
        )
        self.node: Any = node  # a kubernetes.client.V1Node; answered as wire(self.node)
        self.requests: list[Request] = []
        self.invalid: list[str] = []  # requests refused because the client's models refuse their body
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
                server._record(Request("GET", self.path, "", None, time.monotonic(), self._auth()))
                self._send(*server._get(self.path))

            def do_PATCH(self) -> None:
                n = int(self.headers.get("Content-Length", 0))
                body = json.loads(self.rfile.read(n) or b"null")
                ctype = self.headers.get("Content-Type", "")
                req = Request("PATCH", self.path, ctype, body, time.monotonic(), self._auth())
                server._record(req)
                self._send(*server._patch(req))

            def _auth(self) -> str:
                return self.headers.get("Authorization", "")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)

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
    def _record(self, req: Request) -> None:
        with self.lock:
            self.requests.append(req)

    def _name_ok(self, path: str, suffix: str = "") -> bool:
        return path.split("?")[0] == f"/api/v1/nodes/{self.node.metadata.name}{suffix}"

    def _get(self, path: str) -> tuple[int, Any]:
        if not self._name_ok(path):
            return 404, _status(404, "NotFound", f"{path} not found")
        with self.lock:
            return 200, wire(self.node)

    def _patch(self, req: Request) -> tuple[int, Any]:
        status = self._name_ok(req.path, "/status")
        if not status and not self._name_ok(req.path):
            return 404, _status(404, "NotFound", f"{req.path} not found")
        want = STRATEGIC if status else MERGE
        if req.content_type != want:
            return 415, _status(415, "UnsupportedMediaType", f"{req.path}: {req.content_type}, not {want}")
        try:
            req.model = checked(req.body, "V1Node")
        except ModelError as e:
            with self.lock:
                self.invalid.append(f"{req.method} {req.path}: {e}")
            return 400, _status(400, "BadRequest", str(e))
        with self.lock:
            current = wire(self.node)
            rv = (req.body.get("metadata") or {}).get("resourceVersion")
            stale = rv is not None and rv != self.node.metadata.resource_version
            if stale or (not status and self.conflict_next):
                self.conflict_next = max(0, self.conflict_next - (not status))
                return 409, _status(409, "Conflict", "the object has been modified")
            if status:  # the status subresource: only status moves
                after = dict(current, status=strategic_merge_patch(current, req.body)["status"])
            else:  # the node: status does not move through it
                after = dict(merge_patch(current, req.body), status=current["status"])
            version = str(int(current["metadata"]["resourceVersion"]) + 1)
            after["metadata"] = dict(after["metadata"], resourceVersion=version)
            try:
                self.node = checked(after, "V1Node")
            except ModelError as e:  # the patch applied cleanly but left a malformed node
                self.invalid.append(f"{req.method} {req.path}: the node after it: {e}")
                return 422, _status(422, "Invalid", str(e))
            self.changed.notify_all()
            return 200, wire(self.node)

    # ---- what tests read (the official client's models) ----------------------------------------------
    def condition(self, type_: str) -> Any:
        """The node's V1NodeCondition of `type_`, or None."""
        with self.lock:
            return next((c for c in self.node.status.conditions or [] if c.type == type_), None)

    def taints(self) -> list[Any]:
        """The node's taints (V1Taint)."""
        with self.lock:
            return list(self.node.spec.taints or [])

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

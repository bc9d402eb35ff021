"""eddy runtime for Python 3.11: serves a user's handler.py over HTTP (docs/functions.md).

handler.py defines ``main(event, context)``. The event is a dict holding ``data`` (parsed JSON
when the content type is JSON), the CloudEvents attributes as ``ce-*`` keys, and
``extensions`` with ``request`` and ``response``; ``event.emitCloudEvent(type, source, data,
attributes)`` publishes to the event-bus. A returned str is sent as text, bytes as bytes, anything
else as JSON; an exception is a 500 and is logged; a handler still running after FUNC_TIMEOUT
seconds is answered 504. Only the standard library is used, so a function without dependencies
needs no install. Requests are served concurrently, one thread each.
"""

import concurrent.futures
import datetime
import hmac
import http.server
import importlib.util
import json
import os
import signal
import sys
import threading
import traceback
import urllib.parse
import urllib.request
import uuid

PORT = int(os.environ.get("FUNC_PORT", "8080"))
HOST = os.environ.get("FUNC_HOST", "127.0.0.1")
TIMEOUT = float(os.environ.get("FUNC_TIMEOUT", "180"))
PUBLISHER = os.environ.get("PUBLISHER_PROXY_ADDRESS", "")
FUNCTION_DIR = os.environ.get("FUNC_DIR", os.getcwd())
MAX_BODY = int(os.environ.get("FUNC_MAX_BODY_BYTES", str(16 * 1024 * 1024)))
# Locally the gateway sends this secret with every request, so the instance's loopback port
# cannot be called around the gateway's access checks. Kept out of the handler's sight.
INSTANCE_SECRET = os.environ.pop("EDDY_INSTANCE_SECRET", "")
SECRET_HEADER = "x-eddy-instance-secret"
# A publish-only token for emitCloudEvent when the event-bus requires one.
PUBLISHER_TOKEN = os.environ.get("EDDY_PUBLISHER_TOKEN", "")

CONTEXT = {
    "function-name": os.environ.get("FUNC_NAME", ""),
    "namespace": os.environ.get("FUNC_NAMESPACE", ""),
    "timeout": int(TIMEOUT) if TIMEOUT.is_integer() else TIMEOUT,
    "runtime": os.environ.get("FUNC_RUNTIME", "python311"),
}


def load_handler():
    dependencies = os.path.join(FUNCTION_DIR, "deps")
    if os.path.isdir(dependencies):
        sys.path.insert(0, dependencies)
    sys.path.insert(0, FUNCTION_DIR)
    spec = importlib.util.spec_from_file_location("handler", os.path.join(FUNCTION_DIR, "handler.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not callable(getattr(module, "main", None)):
        raise RuntimeError("handler.py must define a function main(event, context)")
    return module.main


try:
    MAIN = load_handler()
except Exception:  # noqa: BLE001 - any load failure ends the instance with its traceback
    print("eddy: cannot load handler.py:", file=sys.stderr)
    traceback.print_exc()
    sys.exit(1)

# Handlers run here so that a slow one can be answered 504 while it goes on.
POOL = concurrent.futures.ThreadPoolExecutor(max_workers=int(os.environ.get("FUNC_THREADS", "64")))


def emit_cloud_event(event_type, source, data, attributes=None):
    """Publishes a CloudEvent to the event-bus; returns its id, raises on refusal."""
    if not PUBLISHER:
        raise RuntimeError("PUBLISHER_PROXY_ADDRESS is not set")
    event_id = str(uuid.uuid4())
    headers = {
        "ce-specversion": "1.0",
        "ce-type": str(event_type),
        "ce-source": str(source),
        "ce-id": event_id,
        "ce-time": datetime.datetime.now(datetime.timezone.utc).isoformat().replace("+00:00", "Z"),
        "content-type": "application/json",
    }
    if PUBLISHER_TOKEN:
        headers["authorization"] = "Bearer " + PUBLISHER_TOKEN
    for name, value in (attributes or {}).items():
        if name == "datacontenttype":
            headers["content-type"] = str(value)
        else:
            headers["ce-" + name] = urllib.parse.quote(str(value), safe="")
    if isinstance(data, (bytes, bytearray)):
        body = bytes(data)
    elif isinstance(data, str):
        body = data.encode()
    else:
        body = json.dumps(data).encode()
    request = urllib.request.Request(PUBLISHER, data=body, headers=headers, method="POST")
    with urllib.request.urlopen(request, timeout=30) as response:
        if response.status >= 300:
            raise RuntimeError(f"event-bus answered {response.status}")
    return event_id


class Event(dict):
    """The event given to main(): a dict with emitCloudEvent()."""

    def emitCloudEvent(self, event_type, source, data, attributes=None):  # noqa: N802 - Kyma's name
        return emit_cloud_event(event_type, source, data, attributes)


class Request:
    """What the handler sees of the HTTP request."""

    def __init__(self, method, path, query, headers, body):
        self.method = method
        self.path = path
        self.query = query
        self.headers = headers
        self.body = body


class Response:
    """Set ``status`` and ``headers`` to shape the answer."""

    def __init__(self):
        self.status = 200
        self.headers = {}


def is_json(content_type):
    media = content_type.split(";")[0].strip().lower()
    return media == "application/json" or media.endswith("+json")


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "eddy-python311"

    def log_message(self, format, *args):  # noqa: A002 - the base class's signature
        pass

    def answer(self, status, body, content_type, headers=None):
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, str(value))
        if content_type and not any(name.lower() == "content-type" for name in (headers or {})):
            self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def from_gateway(self):
        if not INSTANCE_SECRET:
            return True
        given = self.headers.get(SECRET_HEADER, "")
        del self.headers[SECRET_HEADER]
        return hmac.compare_digest(given.encode(), INSTANCE_SECRET.encode())

    def handle_any(self):
        if not self.from_gateway():
            return self.answer(403, b'{"error":"call this function through the eddy gateway"}', "application/json")
        parsed = urllib.parse.urlsplit(self.path)
        if parsed.path == "/healthz" and self.command == "GET":
            return self.answer(200, b"ok", "text/plain")
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY:
            return self.answer(413, b'{"error":"request body too large"}', "application/json")
        body = self.rfile.read(length) if length else b""
        content_type = self.headers.get("Content-Type", "")
        if not body:
            data = None
        elif is_json(content_type):
            try:
                data = json.loads(body)
            except ValueError:
                return self.answer(400, b'{"error":"body is not valid JSON"}', "application/json")
        elif content_type.startswith("text/") or not content_type:
            data = body.decode("utf-8", "replace")
        else:
            data = body
        headers = {name.lower(): value for name, value in self.headers.items()}
        response = Response()
        event = Event(data=data)
        for name, value in headers.items():
            if name.startswith("ce-"):
                event[name] = urllib.parse.unquote(value)
        event["extensions"] = {
            "request": Request(self.command, parsed.path, urllib.parse.parse_qs(parsed.query), headers, data),
            "response": response,
        }
        future = POOL.submit(MAIN, event, CONTEXT)
        try:
            result = future.result(timeout=TIMEOUT)
        except concurrent.futures.TimeoutError:
            print(f"eddy: handler did not finish within {TIMEOUT:g}s", file=sys.stderr, flush=True)
            return self.answer(504, b'{"error":"function timed out"}', "application/json")
        except Exception:  # noqa: BLE001 - any handler failure is a 500, logged
            print("eddy: handler failed:", file=sys.stderr)
            traceback.print_exc()
            sys.stderr.flush()
            return self.answer(500, b'{"error":"function failed"}', "application/json")
        if result is None:
            return self.answer(response.status, b"", None, response.headers)
        if isinstance(result, str):
            return self.answer(response.status, result.encode(), "text/plain; charset=utf-8", response.headers)
        if isinstance(result, (bytes, bytearray)):
            return self.answer(response.status, bytes(result), "application/octet-stream", response.headers)
        try:
            encoded = json.dumps(result).encode()
        except (TypeError, ValueError):
            print("eddy: handler returned a value that is not JSON:", file=sys.stderr)
            traceback.print_exc()
            return self.answer(500, b'{"error":"function returned a value that is not JSON"}', "application/json")
        return self.answer(response.status, encoded, "application/json", response.headers)

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = do_OPTIONS = handle_any


class Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def handle_error(self, request, client_address):
        # A client that went away (a probe that closed, a caller that gave up) is not an error
        # worth a traceback in the function's log.
        if isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            return
        super().handle_error(request, client_address)


def main():
    server = Server((HOST, PORT), Handler)

    def stop(*_):
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(f"eddy: {CONTEXT['function-name']} listening on {PORT}", flush=True)
    # A short poll interval makes SIGTERM take effect quickly.
    server.serve_forever(poll_interval=0.05)
    POOL.shutdown(wait=False, cancel_futures=True)


if __name__ == "__main__":
    main()

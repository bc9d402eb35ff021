// eddy runtime for Node.js 20: serves a user's handler.js over HTTP (docs/functions.md).
//
// handler.js exports `main(event, context)`. The event holds `data` (parsed JSON when the
// content type is JSON), the CloudEvents attributes as `ce-*` keys, `extensions.request` and
// `extensions.response` (Node's http objects), and `emitCloudEvent(type, source, data, attrs)`.
// A returned string is sent as text, a Buffer as bytes, anything else as JSON; a thrown error is
// a 500 and is logged; a handler still running after FUNC_TIMEOUT seconds is answered 504.
// Only Node's standard library is used, so a function without dependencies needs no install.
"use strict";

const http = require("http");
const path = require("path");
const crypto = require("crypto");

const port = Number(process.env.FUNC_PORT || 8080);
const host = process.env.FUNC_HOST || "127.0.0.1";
const timeoutSeconds = Number(process.env.FUNC_TIMEOUT || 180);
const publisher = process.env.PUBLISHER_PROXY_ADDRESS || "";
const functionDir = process.env.FUNC_DIR || process.cwd();
const maxBodyBytes = Number(process.env.FUNC_MAX_BODY_BYTES || 16 * 1024 * 1024);
// Locally the gateway sends this secret with every request, so the instance's loopback port
// cannot be called around the gateway's access checks. Kept out of the handler's sight.
const instanceSecret = process.env.EDDY_INSTANCE_SECRET || "";
delete process.env.EDDY_INSTANCE_SECRET;
const secretHeader = "x-eddy-instance-secret";
// A publish-only token for emitCloudEvent when the event-bus requires one.
const publisherToken = process.env.EDDY_PUBLISHER_TOKEN || "";

function fromGateway(req) {
  if (!instanceSecret) return true;
  const given = Buffer.from(String(req.headers[secretHeader] || ""));
  const wanted = Buffer.from(instanceSecret);
  delete req.headers[secretHeader];
  return given.length === wanted.length && crypto.timingSafeEqual(given, wanted);
}

const context = Object.freeze({
  "function-name": process.env.FUNC_NAME || "",
  namespace: process.env.FUNC_NAMESPACE || "",
  timeout: timeoutSeconds,
  runtime: process.env.FUNC_RUNTIME || "nodejs20",
});

let handler;
try {
  // Dependencies installed next to the handler resolve from its node_modules.
  handler = require(path.join(functionDir, "handler.js"));
} catch (error) {
  console.error("eddy: cannot load handler.js:", error && error.stack ? error.stack : error);
  process.exit(1);
}
if (!handler || typeof handler.main !== "function") {
  console.error("eddy: handler.js must export a function `main(event, context)`");
  process.exit(1);
}

function decodeAttribute(value) {
  try {
    return decodeURIComponent(value);
  } catch (_) {
    return value;
  }
}

function isJson(contentType) {
  const type = (contentType || "").split(";")[0].trim().toLowerCase();
  return type === "application/json" || type.endsWith("+json");
}

async function emitCloudEvent(type, source, data, attributes) {
  if (!publisher) throw new Error("PUBLISHER_PROXY_ADDRESS is not set");
  const headers = {
    "ce-specversion": "1.0",
    "ce-type": String(type),
    "ce-source": String(source),
    "ce-id": crypto.randomUUID(),
    "ce-time": new Date().toISOString(),
    "content-type": "application/json",
  };
  if (publisherToken) headers.authorization = `Bearer ${publisherToken}`;
  for (const [name, value] of Object.entries(attributes || {})) {
    if (name === "datacontenttype") headers["content-type"] = String(value);
    else headers["ce-" + name] = encodeURIComponent(String(value));
  }
  const body =
    typeof data === "string" || Buffer.isBuffer(data) ? data : JSON.stringify(data === undefined ? null : data);
  const response = await fetch(publisher, { method: "POST", headers, body });
  if (!response.ok) {
    throw new Error(`event-bus answered ${response.status}: ${await response.text()}`);
  }
  return headers["ce-id"];
}

function send(res, status, headers, body) {
  if (res.headersSent || res.writableEnded) return;
  res.statusCode = status;
  for (const [name, value] of Object.entries(headers)) {
    if (!res.hasHeader(name)) res.setHeader(name, value);
  }
  res.end(body);
}

function respond(res, result) {
  if (res.writableEnded) return;
  const status = res.statusCode || 200;
  if (result === undefined || result === null) return send(res, status, {}, "");
  if (typeof result === "string") return send(res, status, { "content-type": "text/plain; charset=utf-8" }, result);
  if (Buffer.isBuffer(result)) return send(res, status, { "content-type": "application/octet-stream" }, result);
  return send(res, status, { "content-type": "application/json" }, JSON.stringify(result));
}

function readBody(req) {
  return new Promise((resolve, reject) => {
    const chunks = [];
    let size = 0;
    req.on("data", (chunk) => {
      size += chunk.length;
      if (size > maxBodyBytes) {
        reject(Object.assign(new Error("request body too large"), { status: 413 }));
        req.destroy();
        return;
      }
      chunks.push(chunk);
    });
    req.on("end", () => resolve(Buffer.concat(chunks)));
    req.on("error", reject);
  });
}

async function serve(req, res) {
  if (!fromGateway(req)) {
    return send(res, 403, { "content-type": "application/json" }, JSON.stringify({ error: "call this function through the eddy gateway" }));
  }
  if (req.url === "/healthz" && req.method === "GET") {
    return send(res, 200, { "content-type": "text/plain" }, "ok");
  }
  let body;
  try {
    body = await readBody(req);
  } catch (error) {
    return send(res, error.status || 400, { "content-type": "application/json" }, JSON.stringify({ error: error.message }));
  }
  const contentType = req.headers["content-type"] || "";
  let data;
  if (body.length === 0) data = undefined;
  else if (isJson(contentType)) {
    try {
      data = JSON.parse(body.toString("utf8"));
    } catch (_) {
      return send(res, 400, { "content-type": "application/json" }, JSON.stringify({ error: "body is not valid JSON" }));
    }
  } else if (contentType.startsWith("text/") || contentType === "") data = body.toString("utf8");
  else data = body;

  const event = { data, extensions: { request: req, response: res }, emitCloudEvent };
  for (const [name, value] of Object.entries(req.headers)) {
    if (name.startsWith("ce-")) event[name] = decodeAttribute(String(value));
  }
  req.body = data;

  let timer;
  const timeout = new Promise((_, reject) => {
    timer = setTimeout(() => reject(Object.assign(new Error("timeout"), { eddyTimeout: true })), timeoutSeconds * 1000);
  });
  try {
    const result = await Promise.race([Promise.resolve().then(() => handler.main(event, context)), timeout]);
    respond(res, result);
  } catch (error) {
    if (error && error.eddyTimeout) {
      console.error(`eddy: handler did not finish within ${timeoutSeconds}s`);
      return send(res, 504, { "content-type": "application/json" }, JSON.stringify({ error: "function timed out" }));
    }
    console.error("eddy: handler failed:", error && error.stack ? error.stack : error);
    send(res, 500, { "content-type": "application/json" }, JSON.stringify({ error: "function failed" }));
  } finally {
    clearTimeout(timer);
  }
}

const server = http.createServer((req, res) => {
  serve(req, res).catch((error) => {
    console.error("eddy: request failed:", error);
    send(res, 500, { "content-type": "application/json" }, JSON.stringify({ error: "function failed" }));
  });
});
server.keepAliveTimeout = 65000;
server.listen(port, host, () => {
  console.log(`eddy: ${context["function-name"]} listening on ${port}`);
});

function shutdown() {
  server.close(() => process.exit(0));
  // Idle keep-alive connections would hold close() open.
  server.closeIdleConnections();
  setTimeout(() => process.exit(0), 10000).unref();
}
process.on("SIGTERM", shutdown);
process.on("SIGINT", shutdown);

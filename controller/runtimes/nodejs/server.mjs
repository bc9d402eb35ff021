// eddy's Node.js runtime (nodejs20, nodejs22, nodejs24, nodejs26): serves a function's handler.js
// over HTTP with Kyma Serverless's contract (docs/functions.md): `main(event, context)`, or on
// nodejs26 Kyma's new runtime API, `main(req, res)` with the `sdk` module. Express 5 and body-parser parse the
// request, the CloudEvents SDK reads events, prom-client counts calls, and OpenTelemetry traces
// them; the tracing SDK and its exporter load only when TRACE_COLLECTOR_ENDPOINT is set.
//
// An .mjs file, so a function's own `"type": "module"` cannot change how this server loads.
// Installs bundle it with its libraries into one file (package.json's `bundle`): one file to
// read and compile starts much faster than hundreds.
import crypto from "node:crypto";
import fs from "node:fs";
import http from "node:http";
import Module, * as moduleApi from "node:module";
import path from "node:path";
import process from "node:process";
import { fileURLToPath, pathToFileURL } from "node:url";

import { context as otelContext, propagation, ROOT_CONTEXT, SpanKind, SpanStatusCode, trace } from "@opentelemetry/api";
import bodyParser from "body-parser";
import { CloudEvent, HTTP } from "cloudevents";
import express from "express";
import promClient from "prom-client";

// An error thrown later in a function's async callback must not take the instance down.
process.on("uncaughtException", (error) => console.error("uncaught exception:", error));
process.on("unhandledRejection", (reason) => console.error("unhandled rejection:", reason));

// Locally eddy keeps a warm spare of each runtime in use: this server started ahead of need, its
// libraries loaded (the imports above), waiting for the one instance it becomes. Its first line on
// stdin names that instance's environment and directory; everything below reads them.
const startedAsSpare = Boolean(process.env.EDDY_SPARE);
if (startedAsSpare) await becomeInstance();

async function becomeInstance() {
  process.stdout.write("eddy-spare-ready\n");
  let text = "";
  process.stdin.setEncoding("utf8");
  for await (const chunk of process.stdin) {
    text += chunk;
    const end = text.indexOf("\n");
    if (end < 0) continue;
    process.stdin.destroy();
    const { env: instanceEnv, dir } = JSON.parse(text.slice(0, end));
    for (const name of Object.keys(process.env)) delete process.env[name];
    Object.assign(process.env, instanceEnv);
    process.chdir(dir);
    return;
  }
  // stdin closed before a line came: no instance is wanted.
  process.exit(0);
}

// A cold-started instance gets its secrets (below) as one JSON line on stdin, not in its
// environment, which every process of the same user can read in /proc/<pid>/environ.
if (process.env.EDDY_SECRETS_ON_STDIN) await readSecrets();

async function readSecrets() {
  delete process.env.EDDY_SECRETS_ON_STDIN;
  let text = "";
  process.stdin.setEncoding("utf8");
  for await (const chunk of process.stdin) {
    text += chunk;
    if (text.includes("\n")) break;
  }
  process.stdin.destroy();
  const end = text.indexOf("\n");
  if (end < 0) {
    // Without its secret an instance would take calls from anyone on the machine: refuse to run.
    console.error("eddy: the instance's secrets did not arrive on stdin");
    process.exit(1);
  }
  Object.assign(process.env, JSON.parse(text.slice(0, end)));
}

const env = process.env;
const functionName = env.FUNC_NAME || "";
const namespace = env.SERVICE_NAMESPACE || env.FUNC_NAMESPACE || "";
const runtime = env.FUNC_RUNTIME || "";
// FUNC_PORT and FUNC_HOST are eddy's (the platform sets them); SERVER_PORT and SERVER_HOST are
// the names Kyma's new runtimes read.
const port = Number(env.FUNC_PORT || env.SERVER_PORT || 8080);
const host = env.FUNC_HOST || env.SERVER_HOST || "127.0.0.1";
// Kyma's new runtime API: the function gets Express's request and response.
const requestApi = runtime === "nodejs26";
const timeoutSeconds = positiveNumber(env.FUNC_TIMEOUT, 180);
// FUNC_BODY_MB_LIMIT is Kyma's current name; REQ_MB_LIMIT its older one.
const bodyLimitMb = positiveNumber(env.FUNC_BODY_MB_LIMIT || env.REQ_MB_LIMIT, 1);
const functionDir = env.FUNC_DIR || path.join(path.dirname(new URL(import.meta.url).pathname), "function");
// HANDLER_PATH (Kyma's new runtimes) names the handler file, relative to the function's directory.
const handlerModule = (requestApi && env.HANDLER_PATH) || (env.MOD_NAME || "handler") + ".js";
const handlerName = env.FUNC_HANDLER || "main";
const publisherAddress = env.PUBLISHER_PROXY_ADDRESS || "";

// Locally the gateway sends this secret with every request, so an instance's loopback port cannot
// be called around the gateway's access checks. Kept out of the function's sight.
const instanceSecret = Buffer.from(env.EDDY_INSTANCE_SECRET || "");
delete env.EDDY_INSTANCE_SECRET;
const secretHeader = "x-eddy-instance-secret";
// A publish-only token for emitCloudEvent when the event-bus requires one; also kept hidden.
const publisherToken = env.EDDY_PUBLISHER_TOKEN || "";
delete env.EDDY_PUBLISHER_TOKEN;

function positiveNumber(text, fallback) {
  const value = Number(text);
  return Number.isFinite(value) && value > 0 ? value : fallback;
}

// ---- tracing -------------------------------------------------------------------------------

const tracingProvider = env.TRACE_COLLECTOR_ENDPOINT ? await startTracing(env.TRACE_COLLECTOR_ENDPOINT) : null;
const tracer = trace.getTracer(functionName || "function");

async function startTracing(endpoint) {
  const [{ NodeTracerProvider, BatchSpanProcessor }, { OTLPTraceExporter }, { B3Propagator, B3InjectEncoding }, core, { resourceFromAttributes }] =
    await Promise.all([
      import("@opentelemetry/sdk-trace-node"),
      import("@opentelemetry/exporter-trace-otlp-http"),
      import("@opentelemetry/propagator-b3"),
      import("@opentelemetry/core"),
      import("@opentelemetry/resources"),
    ]);
  const provider = new NodeTracerProvider({
    resource: resourceFromAttributes({ "service.name": `${functionName}.${namespace}` }),
    spanProcessors: [new BatchSpanProcessor(new OTLPTraceExporter({ url: endpoint }))],
  });
  provider.register({
    propagator: new core.CompositePropagator({
      propagators: [new core.W3CTraceContextPropagator(), new B3Propagator({ injectEncoding: B3InjectEncoding.MULTI_HEADER })],
    }),
  });
  return provider;
}

// ---- metrics -------------------------------------------------------------------------------

const metrics = new promClient.Registry();
const callsTotal = new promClient.Counter({ name: "function_calls_total", help: "Calls of the function.", registers: [metrics] });
const failuresTotal = new promClient.Counter({ name: "function_failures_total", help: "Calls that failed.", registers: [metrics] });
// Kyma's spelling of the name, so existing dashboards keep working.
const durationMs = new promClient.Histogram({
  name: "function_duration_miliseconds",
  help: "Time from request to answer, in milliseconds.",
  buckets: [1, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000, 60000],
  registers: [metrics],
});

// ---- isolation -----------------------------------------------------------------------------

// `registerHooks` exists from Node.js 22.15 on; read off the namespace so Node.js 20 loads this.
const { register, registerHooks } = moduleApi;

// A function sees its own node_modules and the runtime's libraries, never packages that happen
// to sit in a directory above it (a project's node_modules, a global install).
// The build directory: where this file is, or for a former spare the directory it was given.
const runtimeDir = startedAsSpare ? process.cwd() : path.dirname(fileURLToPath(import.meta.url));
const allowedRoots = [runtimeDir, path.dirname(fs.realpathSync(path.join(runtimeDir, "node_modules")))].map(
  (root) => root + path.sep,
);
const nodeModulePaths = Module._nodeModulePaths;
Module._nodeModulePaths = (from) => nodeModulePaths(from).filter((dir) => allowedRoots.some((root) => dir.startsWith(root)));
Module.globalPaths.length = 0;
/** A bare specifier resolved outside the allowed roots is reported as not found. */
function checkResolved(specifier, resolved) {
  const bare = !/^(\.|\/|[a-z][a-z0-9+.-]*:)/i.test(specifier);
  if (bare && resolved.url.startsWith("file:") && !allowedRoots.some((root) => fileURLToPath(resolved.url).startsWith(root))) {
    throw Object.assign(new Error(`Cannot find package '${specifier}'`), { code: "ERR_MODULE_NOT_FOUND" });
  }
  return resolved;
}
if (typeof registerHooks === "function") {
  // Node.js 22.15 and later: hooks on this thread, for import() and require() alike.
  registerHooks({ resolve: (specifier, context, next) => checkResolved(specifier, next(specifier, context)) });
} else {
  // Node.js 20: hooks on a worker thread (slower to start), for import() only.
  register(
    "data:text/javascript," +
      encodeURIComponent(`
        import { fileURLToPath } from "node:url";
        let roots = [];
        export function initialize(data) { roots = data.roots; }
        export async function resolve(specifier, context, next) {
          const resolved = await next(specifier, context);
          const bare = !/^(\\.|\\/|[a-z][a-z0-9+.-]*:)/i.test(specifier);
          if (bare && resolved.url.startsWith("file:") && !roots.some((root) => fileURLToPath(resolved.url).startsWith(root))) {
            throw Object.assign(new Error("Cannot find package '" + specifier + "'"), { code: "ERR_MODULE_NOT_FOUND" });
          }
          return resolved;
        }`),
    { data: { roots: allowedRoots } },
  );
}

// ---- secret mounts -------------------------------------------------------------------------

// Locally a Secret cannot be mounted at the path the manifest names (it may be /etc/secrets, and
// there is no container): the files are in a private directory, and reads of the mount path
// through node:fs are sent there. On Kubernetes the Secret is a volume and this is unused.
if (env.EDDY_SECRET_MOUNTS) {
  const mounts = Object.entries(JSON.parse(env.EDDY_SECRET_MOUNTS)).map(([mountPath, dir]) => [
    path.resolve(mountPath).replace(/\/+$/, ""),
    dir,
  ]);
  // The deepest mount first: `/s/inner` inside `/s` shows its own Secret, as on Kubernetes.
  mounts.sort((a, b) => b[0].length - a[0].length);
  delete env.EDDY_SECRET_MOUNTS;
  const remap = (target) => {
    const text = target instanceof URL ? (target.protocol === "file:" ? fileURLToPath(target) : null) : typeof target === "string" ? target : null;
    if (text === null) return target;
    const absolute = path.resolve(text);
    for (const [mountPath, dir] of mounts) {
      if (absolute === mountPath || absolute.startsWith(mountPath + "/")) return dir + absolute.slice(mountPath.length);
    }
    return target;
  };
  const wrap = (api, names) => {
    for (const name of names) {
      const original = api[name];
      if (typeof original === "function") api[name] = (target, ...rest) => original(remap(target), ...rest);
    }
  };
  const reads = ["access", "lstat", "stat", "open", "readFile", "readdir", "realpath", "opendir"];
  wrap(fs, [...reads, ...reads.map((name) => name + "Sync"), "exists", "existsSync", "createReadStream", "watch", "watchFile"]);
  wrap(fs.promises, reads);
  // `import { readFileSync } from "node:fs"` sees the wrapped functions too.
  moduleApi.syncBuiltinESMExports();
}

// ---- the sdk module (Kyma's new runtime API) ------------------------------------------------

// `require("sdk")` finds the runtime's node_modules/sdk, which asks this object for everything.
globalThis[Symbol.for("eddy.runtime")] = Object.freeze({
  tracer,
  functionName,
  namespace,
  runtime,
  timeoutSeconds,
  bodyLimitMb,
  getCloudEvent: (req) => {
    if (!isCloudEvent(req)) return null;
    try {
      return HTTP.toEvent({ headers: utf8Attributes(req.headers), body: req.body });
    } catch {
      return null;
    }
  },
  emitCloudEvent: (type, source, data, optionalAttributes) => emitCloudEvent(type, source, data, optionalAttributes),
});

// ---- the function --------------------------------------------------------------------------

let userFunction;
try {
  const loaded = await import(pathToFileURL(path.resolve(functionDir, handlerModule)).href);
  // ES modules export `main`; CommonJS exports arrive as `default` (and usually as `main` too).
  const candidate = loaded[handlerName] ?? loaded.default?.[handlerName];
  if (typeof candidate === "function") userFunction = candidate;
  else console.error(`${handlerModule} does not export a function \`${handlerName}\``);
} catch (error) {
  console.error(`cannot load ${handlerModule}:`, error);
}

const functionContext = Object.freeze({
  "function-name": functionName,
  namespace,
  runtime,
  timeout: timeoutSeconds,
  "body-size-limit": bodyLimitMb,
});

/**
 * A binary-mode attribute header's value. Past ASCII it came as raw UTF-8 (a Subscription in
 * Kyma's form is delivered so, as CloudEvents' Go SDK writes it), which Node reads as Latin-1:
 * read back as UTF-8, not percent-decoded. Otherwise percent-decoded (the HTTP binding).
 */
function headerAttribute(value) {
  if (typeof value === "string" && /[\u0080-\u00ff]/.test(value)) return Buffer.from(value, "latin1").toString("utf8");
  return decodeAttribute(value);
}

/**
 * `headers` with raw UTF-8 `ce-*` values (Node reads them as Latin-1) read back as UTF-8, for
 * the CloudEvents SDK, which takes header values as they come; the rest as they are.
 */
function utf8Attributes(headers) {
  let copy;
  for (const [name, value] of Object.entries(headers)) {
    if (name.startsWith("ce-") && typeof value === "string" && /[\u0080-\u00ff]/.test(value)) {
      copy ??= { ...headers };
      copy[name] = Buffer.from(value, "latin1").toString("utf8");
    }
  }
  return copy ?? headers;
}

/** Percent-decodes a binary-mode attribute (the HTTP binding encodes them). */
function decodeAttribute(value) {
  if (typeof value !== "string" || !value.includes("%")) return value;
  try {
    return decodeURIComponent(value);
  } catch {
    return value;
  }
}

function isCloudEvent(req) {
  return mediaType(req) === "application/cloudevents+json" || (req.headers["ce-type"] !== undefined && req.headers["ce-source"] !== undefined);
}

/** The `event` a function receives. Throws when the request claims to be an invalid CloudEvent. */
function buildEvent(req, res) {
  const event = {
    extensions: { request: req, response: res },
    setResponseHeader: (name, value) => res.set(name, value),
    setResponseContentType: (type) => res.type(type),
    setResponseStatus: (status) => res.status(status),
    emitCloudEvent,
    publishCloudEvent,
    buildResponseCloudEvent,
    tracer,
  };
  if (mediaType(req).startsWith("multipart/")) return event;
  if (!isCloudEvent(req)) {
    event.data = req.body;
    return event;
  }
  if (isBinaryModeEvent(req)) {
    // What the SDK's binary-mode reader gives, without its copies of every header and of the
    // event (a tenth of a delivery's cost here): attributes from the ce-* headers, the content
    // type as datacontenttype, the body as body-parser parsed it as data. The SDK does not
    // validate binary-mode events either.
    for (const name in req.headers) {
      if (name.startsWith("ce-")) event[name] = headerAttribute(req.headers[name]);
    }
    const time = new Date(event["ce-time"]);
    if (event["ce-time"] !== undefined && !Number.isNaN(time.getTime())) event["ce-time"] = time.toISOString();
    if (req.headers["content-type"] !== undefined) event["ce-datacontenttype"] = req.headers["content-type"];
    event.data = req.body;
    return event;
  }
  const body = Buffer.isBuffer(req.body) ? req.body : req.body === undefined ? "" : req.body;
  const cloudEvent = HTTP.toEvent({ headers: utf8Attributes(req.headers), body });
  for (const [name, value] of Object.entries(cloudEvent)) {
    if (name !== "data" && name !== "data_base64") event[`ce-${name}`] = decodeAttribute(value);
  }
  event.data = cloudEvent.data;
  return event;
}

/** A complete binary-mode CloudEvent 1.0 (anything else goes to the SDK, which says what is wrong). */
function isBinaryModeEvent(req) {
  const headers = req.headers;
  return (
    headers["ce-specversion"] === "1.0" &&
    headers["ce-id"] !== undefined &&
    headers["ce-type"] !== undefined &&
    headers["ce-source"] !== undefined &&
    mediaType(req) !== "application/cloudevents+json"
  );
}

/** Posts a structured CloudEvent to the event publisher; resolves to axios's response. */
async function postCloudEvent(cloudEvent) {
  if (!publisherAddress) throw new Error("PUBLISHER_PROXY_ADDRESS is not set");
  const message = HTTP.structured(cloudEvent);
  const headers = { ...message.headers };
  if (publisherToken) headers.authorization = `Bearer ${publisherToken}`;
  propagation.inject(otelContext.active(), headers);
  // axios loads on first use: most functions never emit events.
  const { default: axios } = await import("axios");
  return axios.post(publisherAddress, message.body, { headers });
}

async function emitCloudEvent(type, source, data, optionalAttributes) {
  const attributes = { ...(optionalAttributes || {}) };
  if (attributes.datacontenttype === undefined && data !== undefined && data !== null) {
    attributes.datacontenttype = typeof data === "string" ? "text/plain" : "application/json";
  }
  return postCloudEvent(new CloudEvent({ ...attributes, type, source, data, id: attributes.id || crypto.randomUUID() }));
}

/** Deprecated in Kyma, kept for functions that still call it. */
function publishCloudEvent(cloudEvent) {
  return postCloudEvent(cloudEvent instanceof CloudEvent ? cloudEvent : new CloudEvent(cloudEvent));
}

/** Deprecated in Kyma, kept for functions that still call it. */
function buildResponseCloudEvent(id, type, data) {
  return new CloudEvent({ id, type, source: functionName, data });
}

/** Kyma's answer rules: objects as JSON, strings and bytes as they are, nothing as an empty 200. */
function makeSendResponse(res) {
  return (body, status, headers) => {
    if (res.headersSent) return;
    for (const [name, value] of Object.entries(headers || {})) res.set(name, value);
    if (status) res.status(status);
    if (body === undefined || body === null || body === "" || body === false) {
      if (status) res.sendStatus(status);
      else res.end();
    } else if (Buffer.isBuffer(body)) {
      if (!res.get("content-type")) res.type("application/octet-stream");
      res.end(body);
    } else if (typeof body === "object") {
      res.json(body);
    } else {
      if (!res.get("content-type")) res.type("text/plain; charset=utf-8");
      res.end(String(body));
    }
  };
}

/** A thrown or rejected string is the answer's body; anything else stays in the log. */
function answerError(error, span, sendResponse) {
  const message = typeof error === "string" ? error : "Internal server error";
  console.error("function failed:", error);
  span.setStatus({ code: SpanStatusCode.ERROR, message: typeof error === "string" ? error : String(error?.message ?? error) });
  sendResponse(message, 500);
}

/** Kyma's new runtime API: `main(req, res)`; the function answers through `res`. A thrown or
 * rejected string is the answer's body; anything else is a 500 "Internal server error". */
async function callRequestFunction(req, res, span) {
  const sendResponse = (body, status) => {
    if (!res.headersSent) res.status(status).send(body);
  };
  try {
    await userFunction(req, res);
  } catch (error) {
    failuresTotal.inc();
    answerError(error, span, sendResponse);
  }
}

async function callFunction(req, res) {
  callsTotal.inc();
  const started = performance.now();
  res.once("finish", () => durationMs.observe(performance.now() - started));
  if (!userFunction) {
    failuresTotal.inc();
    res.status(500).type("text/plain").send("User function not loaded");
    return;
  }
  const parent = propagation.extract(ROOT_CONTEXT, req.headers);
  const span = tracer.startSpan(`${req.method} ${req.path}`, { kind: SpanKind.SERVER }, parent);
  const sendResponse = makeSendResponse(res);
  const timer = setTimeout(() => {
    if (res.headersSent) return;
    console.error(`function did not answer within ${timeoutSeconds}s`);
    failuresTotal.inc();
    span.setStatus({ code: SpanStatusCode.ERROR, message: "timeout" });
    res.sendStatus(408);
  }, timeoutSeconds * 1000);
  try {
    await otelContext.with(trace.setSpan(parent, span), async () => {
      if (requestApi) return callRequestFunction(req, res, span);
      let event;
      try {
        event = buildEvent(req, res);
      } catch (error) {
        res.status(400).type("text/plain").send(`invalid CloudEvent: ${error?.message ?? error}`);
        return;
      }
      try {
        sendResponse(await userFunction(event, functionContext, sendResponse));
      } catch (error) {
        failuresTotal.inc();
        answerError(error, span, sendResponse);
      }
    });
  } finally {
    const finish = () => {
      clearTimeout(timer);
      span.setAttribute("http.response.status_code", res.statusCode);
      span.end();
    };
    // A `main(req, res)` may answer after it returns (from a callback): the timeout holds until
    // the response ends, as Kyma's does.
    if (requestApi && !res.writableEnded) res.once("close", finish);
    else finish();
  }
}

// ---- the server ----------------------------------------------------------------------------

// The function gets Express's request and response, and bodies parsed by body-parser as
// Express apps parse them. The routing around them is four fixed routes, so requests go to them
// straight from Node's HTTP server, without Express's router and middleware chain in the way.
const app = express();
app.disable("x-powered-by");
app.set("etag", false);

const limit = `${bodyLimitMb}mb`;
const parseJson = bodyParser.json({ type: () => true, limit, strict: false });
const parseText = bodyParser.text({ type: () => true, limit });
const parseForm = bodyParser.urlencoded({ type: () => true, limit, extended: true });
const parseRaw = bodyParser.raw({ type: () => true, limit });

/**
 * The request's media type, lower case without parameters ("" without a content type). Read
 * once per request: the three places that need it would otherwise each parse the header.
 */
function mediaType(req) {
  if (req.eddyMediaType === undefined) {
    const header = req.headers["content-type"] || "";
    const end = header.indexOf(";");
    req.eddyMediaType = (end === -1 ? header : header.slice(0, end)).trim().toLowerCase();
  }
  return req.eddyMediaType;
}

/** The body parser for a request's content type; multipart is left to the function. */
function bodyParserFor(req) {
  const type = mediaType(req);
  if (type === "application/json" || type === "application/cloudevents+json") return parseJson;
  if (type.startsWith("text/")) return parseText;
  if (type === "application/x-www-form-urlencoded") return parseForm;
  // Kyma's new runtime API gives multipart bodies raw, as Kyma's nodejs26 does.
  if (type.startsWith("multipart/")) return requestApi ? parseRaw : null;
  // body-parser reads nothing from a request without a body.
  return parseRaw;
}

function readBody(req, res) {
  const parse = bodyParserFor(req);
  if (!parse) return Promise.resolve();
  return new Promise((resolve, reject) => parse(req, res, (error) => (error ? reject(error) : resolve())));
}

// SERVER_INTERNAL_LOGGER: each request logged in Apache's combined format (morgan), as Kyma's.
const requestLogger = env.SERVER_INTERNAL_LOGGER ? (await import("morgan")).default("combined") : null;

function fromGateway(req) {
  if (instanceSecret.length === 0) return true;
  const given = Buffer.from(String(req.headers[secretHeader] || ""));
  delete req.headers[secretHeader];
  return given.length === instanceSecret.length && crypto.timingSafeEqual(given, instanceSecret);
}

async function serve(req, res) {
  // What Express does to every request before its router (its request and response methods are
  // already there: see ExpressRequest below).
  req.res = res;
  res.req = req;
  req.originalUrl = req.url;
  req.baseUrl = "";
  req.params = {};
  res.locals = Object.create(null);
  if (requestLogger) await new Promise((resolve) => requestLogger(req, res, resolve));
  if (!fromGateway(req)) {
    res.status(403).json({ error: "call this function through the eddy gateway" });
    return;
  }
  if (req.method === "GET") {
    switch (req.path) {
      case "/healthz":
        res.status(200).type("text/plain").send("OK");
        return;
      case "/metrics":
        res.type(metrics.contentType).send(await metrics.metrics());
        return;
      case "/favicon.ico":
        res.status(204).end();
        return;
    }
  }
  res.set("Access-Control-Allow-Origin", "*");
  if (req.method === "OPTIONS") {
    // A CORS preflight: allow what was asked for, without calling the function; 200 with an
    // empty body, as Kyma's runtime answers it (`res.end()`).
    const method = req.headers["access-control-request-method"];
    const headers = req.headers["access-control-request-headers"];
    if (method) res.set("Access-Control-Allow-Methods", method);
    if (headers) res.set("Access-Control-Allow-Headers", headers);
    res.status(200).end();
    return;
  }
  req.params = { path: req.path.split("/").filter(Boolean) };
  await readBody(req, res);
  await callFunction(req, res);
}

// Express gives each request its methods by changing the prototype of Node's request and
// response objects (Object.setPrototypeOf). V8 then gives each of them a map of its own, and
// those outlive the request: a third of what a request allocates survived each young-generation
// GC, which took 2-4 ms instead of 0.2-0.4 and left old space to grow until a full GC. Node
// builds its request and response objects from classes it is given, so they are made with
// Express's prototypes from the start.
class ExpressRequest extends http.IncomingMessage {}
Object.setPrototypeOf(ExpressRequest.prototype, app.request);
class ExpressResponse extends http.ServerResponse {}
Object.setPrototypeOf(ExpressResponse.prototype, app.response);

const server = http.createServer({ IncomingMessage: ExpressRequest, ServerResponse: ExpressResponse }, (req, res) => {
  serve(req, res).catch((error) => {
    // A body past REQ_MB_LIMIT, malformed JSON: said in plain words with their status.
    if (res.headersSent) {
      res.destroy();
      return;
    }
    const status = Number(error?.status || error?.statusCode || 500);
    if (status >= 500) console.error("request failed:", error);
    res.status(status).type("text/plain").send(status < 500 ? String(error.message) : "Internal server error");
  });
});
server.keepAliveTimeout = 65000;
server.listen(port, host, () => {
  console.log(`eddy: ${functionName} listening on ${port}`);
  // In a pod the container's postStart hook waits for this file, so the kubelet's first readiness
  // probe comes when the server can answer, instead of a probe period after a refused one.
  if (env.EDDY_SERVING_FILE) {
    fs.writeFile(env.EDDY_SERVING_FILE, "", (error) => error && console.error(`eddy: cannot write ${env.EDDY_SERVING_FILE}:`, error.message));
  }
});

function shutdown() {
  server.close(() => {
    Promise.resolve(tracingProvider?.shutdown()).finally(() => process.exit(0));
  });
  // Idle keep-alive connections would hold close() open.
  server.closeIdleConnections();
  setTimeout(() => process.exit(0), 10000).unref();
}
process.on("SIGTERM", shutdown);
process.on("SIGINT", shutdown);

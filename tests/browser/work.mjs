// Works in the eddy dashboard as a user would, in headless Chromium (Debian's, via
// playwright-core), and prints what it saw at each step as JSON for tests/dashboard.rs:
// gives the API token when asked, deploys a function from the editor (after a refused name),
// calls it, reads its log, publishes events and opens them, finds the dead letter, fixes the
// function and redrives it, and reads the flow map and charts. Screenshots of each page go to
// SCREENSHOT_DIR.
//
// Usage: node work.mjs URL TOKEN SCREENSHOT_DIR
import { chromium } from "playwright-core";

const [url, token, screenshots] = process.argv.slice(2);
const TIMEOUT = 90000;
const seen = {};
let step = "start";

// The function a user writes: greets by name, refuses a call without one (400), and answers
// events with a CloudEvent of its own.
const strictSource = `module.exports = {
  main: async function (event, context) {
    const name = event.data && event.data.name;
    if (!name) {
      event.setResponseStatus(400);
      return "name is required";
    }
    console.log("greeting", name);
    event.setResponseHeader("ce-specversion", "1.0");
    event.setResponseHeader("ce-type", "com.example.greeted.v1");
    event.setResponseHeader("ce-source", "greeter");
    event.setResponseHeader("ce-id", "greeted-" + (event["ce-id"] || Date.now()));
    return { hello: name };
  },
};
`;
// The fix: no name means "world".
const fixedSource = `module.exports = {
  main: async function (event, context) {
    const name = (event.data && event.data.name) || "world";
    console.log("greeting", name);
    event.setResponseHeader("ce-specversion", "1.0");
    event.setResponseHeader("ce-type", "com.example.greeted.v1");
    event.setResponseHeader("ce-source", "greeter");
    event.setResponseHeader("ce-id", "greeted-" + (event["ce-id"] || Date.now()));
    return { hello: name };
  },
};
`;

const browser = await chromium.launch({
  executablePath: process.env.EDDY_CHROMIUM || "/usr/bin/chromium",
  headless: true,
  args: ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync"],
});
const page = await browser.newPage({ viewport: { width: 1400, height: 1000 } });
// Every action (a click waits for its target to be enabled) gets the same patience as the waits:
// on a loaded CI machine Playwright's 30 s default is not enough.
page.setDefaultTimeout(TIMEOUT);
page.setDefaultNavigationTimeout(TIMEOUT);
const text = (selector) => page.textContent(selector).then((t) => (t || "").trim());
const waitFor = (what, fn, arg) => {
  step = what;
  return page.waitForFunction(fn, arg, { timeout: TIMEOUT });
};
const shot = (name) => page.screenshot({ path: `${screenshots}/dashboard-${name}.png`, fullPage: true });
async function waitForCallStatus(expected) {
  await waitFor(`call answered ${expected}`, (want) => {
    const status = document.querySelector("#call-status").textContent;
    return status.startsWith(want);
  }, expected);
}

try {
  // The API wants a token: the page asks once and keeps it for the tab.
  step = "token prompt";
  await page.goto(url);
  await page.waitForSelector("#token-dialog[open]", { timeout: TIMEOUT });
  seen.askedForToken = true;
  await page.fill("#token-input", token);
  await page.click("#token-form button[type=submit]");
  await waitFor("summary after the token", () => /functions/.test(document.querySelector("#summary").textContent));
  seen.tokenInUrl = page.url().includes(token);

  // The editor: a refused name is shown on its field, then the function deploys and runs.
  step = "editor";
  await page.click('header nav a[data-page="functions"]');
  await page.fill("#f-name", "Greeter_1");
  await page.fill("#f-source", strictSource);
  await page.click("#save");
  await waitFor("a field error on the name", () => document.querySelector("#f-name").classList.contains("invalid") &&
    document.querySelector("#f-name").parentElement.querySelector(".field-error").textContent.length > 0);
  seen.nameError = await page.$eval("#f-name", (input) => input.parentElement.querySelector(".field-error").textContent);
  await page.fill("#f-name", "greeter");
  await page.click("#save");
  await waitFor("greeter running", () => {
    const pills = [...document.querySelectorAll("#function-status .pill")];
    return pills.length === 2 && pills.every((p) => p.classList.contains("True"));
  });
  seen.functionStatus = await text("#function-status");

  // Calls: 400 without a name, 200 with one; then its log line.
  step = "call";
  await page.fill("#c-body", '{"name": "ada"}');
  await page.click("#send");
  await waitForCallStatus("200");
  seen.call = { status: await text("#call-status"), body: await text("#call-body"), headers: await text("#call-headers") };
  await waitFor("the log line", () => document.querySelector("#logs").textContent.includes("greeting ada"));
  seen.log = await text("#logs");
  await shot("functions");

  // Events: publish one from the form, open it, and see it delivered.
  step = "publish";
  await page.click('header nav a[data-page="events"]');
  await page.fill("#p-type", "com.example.greet.v1");
  await page.fill("#p-data", '{"name": "grace"}');
  await page.click("#publish button[type=submit]");
  await waitFor("the published event opened and delivered", () =>
    document.querySelector("#detail-title").textContent.includes("com.example.greet.v1") &&
    [...document.querySelectorAll("#deliveries tbody tr")].some((tr) => tr.textContent.includes("delivered")));
  seen.published = {
    message: await text("#publish-message"),
    title: await text("#detail-title"),
    attributes: await page.$$eval("#attributes tr", (trs) => Object.fromEntries(trs.map((tr) => [tr.cells[0].textContent, tr.cells[1].textContent]))),
    data: await page.textContent("#event-data"),
    deliveries: await page.$$eval("#deliveries tbody tr", (trs) => trs.map((tr) => [...tr.cells].map((td) => td.textContent.trim()))),
  };
  await shot("events");

  // An event the function refuses goes to dead letters; its detail says so.
  step = "dead letter";
  await page.fill("#p-data", '{"nobody": true}');
  await page.fill("#p-id", "refused-1");
  await page.click("#publish button[type=submit]");
  await waitFor("the refused event opened and dead-lettered", () =>
    document.querySelector("#detail-title").textContent.includes("com.example.greet.v1") &&
    document.querySelector("#attributes").textContent.includes("refused-1") &&
    [...document.querySelectorAll("#deliveries tbody tr")].some((tr) => tr.textContent.includes("dead letter")));
  seen.refused = await page.$$eval("#deliveries tbody tr", (trs) => trs.map((tr) => [...tr.cells].map((td) => td.textContent.trim())));

  // The overview: flow map and charts, drawn.
  step = "overview";
  await page.click('header nav a[data-page="overview"]');
  await waitFor("the flow map with the reply type", () => {
    const labels = [...document.querySelectorAll("#flow svg text")].map((t) => t.textContent);
    return labels.includes("com.example.greeted.v1") && labels.includes("greeter");
  });
  seen.flow = {
    labels: await page.$$eval("#flow svg g.node text", (nodes) => nodes.map((n) => n.textContent)),
    edges: await page.$$eval("#flow svg path.edge", (paths) => paths.length),
  };
  // Rates need two intervals sampled since the subscription and the function appeared; p99
  // has a point for each interval with calls.
  await waitFor("charts with lines", () => [
    ['#subscription-charts [data-chart="default/greetings"] polyline[data-series="delivered"]', 2],
    ['#function-charts [data-chart="default/greeter calls/s"] polyline[data-series="calls"]', 2],
    ['#function-charts [data-chart="default/greeter p99 ms"] polyline[data-series="p99"]', 1],
  ].every(([selector, points]) => {
    const line = document.querySelector(selector);
    return line && line.getAttribute("points").split(" ").length >= points;
  }));
  seen.charts = await page.$$eval(".chart", (charts) => charts.map((chart) => ({
    title: chart.dataset.chart,
    lines: [...chart.querySelectorAll("polyline")].map((line) => [line.dataset.series, line.getAttribute("points").split(" ").length]),
  })));
  await shot("overview");

  // Dead letters: the refused event, with why; fix the function, then redrive it.
  step = "dead letters page";
  await page.click('header nav a[data-page="dead-letters"]');
  await waitFor("the dead letter listed", () => document.querySelectorAll('.subscription-letters[data-subscription="default/greetings"] tbody tr').length === 1);
  seen.deadLetters = await page.$$eval(".subscription-letters tbody tr", (trs) => trs.map((tr) => [...tr.cells].map((td) => td.textContent.trim())));
  await shot("dead-letters");

  step = "fix";
  await page.click('header nav a[data-page="functions"]');
  // The editor still shows the deployed source: emptied first, the wait below sees the reload
  // land (text filled in before it lands would be overwritten by it).
  await page.fill("#f-source", "");
  await page.selectOption("#pick-function", "default/greeter");
  await waitFor("the editor loaded greeter", () => document.querySelector("#f-source").value.includes("name is required"));
  await page.fill("#f-source", fixedSource);
  await page.click("#save");
  // The new version answers a call without a name.
  step = "the fixed version runs";
  const deadline = Date.now() + TIMEOUT;
  await page.fill("#c-body", "{}");
  for (;;) {
    await page.click("#send");
    await page.waitForFunction(() => /^\d{3}/.test(document.querySelector("#call-status").textContent), null, { timeout: TIMEOUT });
    if ((await text("#call-status")).startsWith("200")) break;
    if (Date.now() > deadline) throw new Error("the fixed version never answered 200");
    await page.waitForTimeout(500);
  }
  seen.fixedCall = await text("#call-body");

  step = "redrive";
  await page.click('header nav a[data-page="dead-letters"]');
  await page.click('.redrive[data-subscription="default/greetings"]');
  await waitFor("no dead letters left", () => document.querySelector("#dead-letters").textContent.includes("no dead letters"));
  seen.redrive = await text("#dead-letters");
  console.log(JSON.stringify(seen));
} catch (error) {
  await page.screenshot({ path: `${screenshots}/dashboard-failed.png`, fullPage: true }).catch(() => {});
  // What the page said when it stopped, so a failure in CI explains itself without the screenshot.
  const shown = await page.evaluate(() => Object.fromEntries(["#summary", "#function-status", "#save-message",
    "#call-status", "#publish-message", "#detail-title", "#deliveries", "#dead-letters"]
    .map((selector) => [selector, (document.querySelector(selector)?.textContent || "").trim().slice(0, 400)]))).catch(() => ({}));
  console.error(`dashboard step "${step}" failed: ${error.message}\nthe page showed: ${JSON.stringify(shown)}\nseen so far: ${JSON.stringify(seen)}`);
  process.exitCode = 1;
} finally {
  await browser.close();
}

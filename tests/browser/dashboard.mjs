// Loads the eddy dashboard in headless Chromium (Debian's, via playwright-core), waits until it
// shows what the calling test expects, and prints what it shows as JSON.
//
// Usage: node dashboard.mjs URL MIN_EVENTS MIN_DELIVERED [SCREENSHOT.png]
// (MIN_DELIVERED: the delivered counts of all subscriptions added up.)
import { chromium } from "playwright-core";

const [url, minEvents, minDelivered, screenshot] = process.argv.slice(2);
const browser = await chromium.launch({
  executablePath: process.env.EDDY_CHROMIUM || "/usr/bin/chromium",
  headless: true,
  args: ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync"],
});
try {
  const page = await browser.newPage({ viewport: { width: 1400, height: 1000 } });
  await page.goto(url);
  await page.waitForFunction(
    (min) => document.querySelectorAll("#tail tr.event").length >= min &&
      document.querySelectorAll("#functions tbody tr td:not(.empty)").length > 0,
    Number(minEvents),
    { timeout: 20000 },
  );
  // The delivery counts come with the state the page polls: wait until they are all in.
  await page.waitForFunction(
    (min) => [...document.querySelectorAll("#subscriptions tbody tr")]
      .map((tr) => Number(tr.cells[5] ? tr.cells[5].textContent : NaN))
      .reduce((sum, n) => sum + (Number.isFinite(n) ? n : 0), 0) >= min,
    Number(minDelivered),
    { timeout: 20000 },
  );
  const rows = (selector) => page.$$eval(selector, (trs) => trs.map((tr) => [...tr.cells].map((td) => td.textContent.trim())));
  const result = {
    summary: await page.textContent("#summary"),
    functions: await rows("#functions tbody tr"),
    subscriptions: await rows("#subscriptions tbody tr"),
    events: await rows("#tail tbody tr.event"),
  };
  if (screenshot) await page.screenshot({ path: screenshot, fullPage: true });
  console.log(JSON.stringify(result));
} finally {
  await browser.close();
}

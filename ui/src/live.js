// pg-once-ui: follow the server's events for this page's live region (no polling: the
// server re-renders the region when pg_once announces a change, shared by all viewers).
"use strict";
(function () {
  const live = document.getElementById("live");
  const status = document.getElementById("status");
  function bindSelectAll() {
    const all = document.getElementById("all");
    if (all) all.addEventListener("change", () => {
      for (const box of document.querySelectorAll("input[name=key]")) box.checked = all.checked;
    });
  }
  bindSelectAll();
  if (!live || !live.dataset.events || !window.EventSource) return;
  const events = new EventSource(live.dataset.events);
  events.addEventListener("open", () => { status.dataset.state = "live"; document.body.dataset.live = "connected"; });
  events.addEventListener("error", () => { status.dataset.state = "off"; document.body.dataset.live = "lost"; });
  events.addEventListener("update", (e) => {
    // Keep the boxes a person ticked across the update.
    const ticked = new Set(Array.from(document.querySelectorAll("input[name=key]:checked"), (b) => b.value));
    live.innerHTML = e.data;
    for (const box of document.querySelectorAll("input[name=key]")) box.checked = ticked.has(box.value);
    bindSelectAll();
    document.body.dataset.updates = String(Number(document.body.dataset.updates || 0) + 1);
  });
})();

// The web chat widget (channels/webchat): one tag on any page of an allowed site,
//   <script src="https://gateway.example/webchat/widget.js" data-title="Help" async></script>
// adds a button that opens the chat in a frame served by the gateway. The frame shows the
// chat only on the sites of [channels.web] allowed_origins (the gateway checks the origin
// passed here, and the browser checks the frame's CSP frame-ancestors). Styles are set
// through the DOM, so a site's strict CSP (no inline styles) lets the widget work.
"use strict";

(() => {
  const script = document.currentScript;
  if (!script || window.__gatewayWebchat) return;
  window.__gatewayWebchat = true;
  const source = new URL(script.src);
  const base = source.origin + source.pathname.replace(/widget\.js$/, "");
  const label = script.dataset.title || "Chat";
  const side = script.dataset.position === "left" ? "left" : "right";
  const accent = /^#[0-9a-fA-F]{3,8}$/.test(script.dataset.color || "") ? script.dataset.color : "#1f5fd1";

  const button = document.createElement("button");
  button.type = "button";
  button.textContent = label;
  button.setAttribute("aria-expanded", "false");
  button.setAttribute("aria-controls", "gateway-webchat-frame");
  Object.assign(button.style, {
    position: "fixed", bottom: "1rem", [side]: "1rem", zIndex: "2147483646",
    padding: ".7rem 1.1rem", border: "0", borderRadius: "2rem", cursor: "pointer",
    background: accent, color: "#fff", font: "600 16px system-ui, sans-serif",
    boxShadow: "0 .3rem 1rem rgba(0,0,0,.25)",
  });

  const frame = document.createElement("iframe");
  frame.id = "gateway-webchat-frame";
  frame.title = label;
  frame.hidden = true;
  // The frame may run its own scripts and keep its own cookie, never steer this page.
  frame.setAttribute("sandbox", "allow-scripts allow-same-origin allow-forms allow-popups allow-popups-to-escape-sandbox allow-downloads");
  frame.setAttribute("allow", "clipboard-write");
  frame.src = `${base}frame?origin=${encodeURIComponent(location.origin)}`;
  Object.assign(frame.style, {
    position: "fixed", bottom: "4.5rem", [side]: "1rem", zIndex: "2147483647",
    width: "min(26rem, calc(100vw - 2rem))", height: "min(40rem, calc(100vh - 6rem))",
    border: "1px solid #d9dde5", borderRadius: ".8rem", background: "#fff",
    boxShadow: "0 .5rem 2rem rgba(0,0,0,.3)",
  });

  function toggle(open) {
    frame.hidden = !open;
    button.setAttribute("aria-expanded", String(open));
    if (open) frame.focus();
    else button.focus();
  }

  button.addEventListener("click", () => toggle(frame.hidden));
  document.addEventListener("keydown", (event) => {
    if (event.key === "Escape" && !frame.hidden) toggle(false);
  });

  function mount() {
    document.body.append(frame, button);
  }
  if (document.body) mount();
  else document.addEventListener("DOMContentLoaded", mount);
})();

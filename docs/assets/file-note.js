// Opened from disk (file://), the site works but for search: a browser refuses search's worker script from a file.
// Instead of a search box that does nothing, the header says what to run.
if (location.protocol === "file:") {
  document.addEventListener("DOMContentLoaded", () => {
    const search = document.querySelector(".md-search");
    if (search) search.style.display = "none";
    const header = document.querySelector(".md-header__inner");
    if (!header) return;
    const note = document.createElement("span");
    note.className = "difftx-file-note";
    note.textContent = "search needs the served site: make docs-serve";
    note.style.cssText = "margin-left: auto; font-size: 0.7rem; opacity: 0.8; white-space: nowrap;";
    header.appendChild(note);
  });
}

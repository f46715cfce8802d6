// The pages' formulas ($...$ and $$...$$, which pymdownx.arithmatex marks) typeset by KaTeX, vendored in
// javascripts/katex/ (npm package katex 0.16.47, MIT License; its woff2 fonts only): no network, file:// included.
document$.subscribe(({ body }) => {
  for (const element of body.querySelectorAll(".arithmatex")) {
    renderMathInElement(element, {
      delimiters: [
        { left: "\\(", right: "\\)", display: false },
        { left: "\\[", right: "\\]", display: true },
      ],
      throwOnError: false,
    })
  }
})

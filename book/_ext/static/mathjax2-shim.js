// The Jupyter widget manager calls MathJax 2's MathJax.Hub.Queue(["Typeset", Hub, element]);
// the book loads MathJax 3. Map the old call onto MathJax 3's typesetPromise.
(function () {
  if (!window.MathJax || window.MathJax.Hub) return;
  window.MathJax.Hub = {
    Queue: function () {
      var nodes = [];
      Array.prototype.forEach.call(arguments, function (job) {
        if (Array.isArray(job)) job.forEach(function (x) { if (x instanceof Element) nodes.push(x); });
      });
      if (window.MathJax.typesetPromise) return window.MathJax.typesetPromise(nodes.length ? nodes : undefined);
    }
  };
})();

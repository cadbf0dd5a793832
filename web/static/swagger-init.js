// Swagger UI at /docs (web/templates/swagger_ui.html): the spec's URL and flask-smorest's settings come
// as JSON data in the page; every request carries the API key that mlxq's page keeps in localStorage.
"use strict";

(function () {
  const settings = JSON.parse(document.getElementById("swagger-ui-settings").textContent);
  const config = {
    url: settings.url,
    dom_id: "#swagger-ui-container",
    requestInterceptor: function (request) {
      const key = localStorage.getItem("mlxq_key");
      if (key && !request.headers.Authorization) { request.headers.Authorization = "Bearer " + key; }
      return request;
    },
  };
  Object.assign(config, settings.override);
  window.addEventListener("load", function () { window.ui = SwaggerUIBundle(config); });
})();

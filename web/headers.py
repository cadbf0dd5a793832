"""Security headers on every response: no MIME sniffing, no framing, and a Content-Security-Policy.

The pages (`/`, Swagger UI at `/docs`) load only this server's own scripts, styles and images and
talk only to this server: the page keeps the API key in localStorage, so a script injected from
anywhere else must not run, and no other site may frame them (clickjacking). rq-dashboard's pages
(`/rq`) run one inline script, allowed by a nonce given to that response alone (its template is
web/templates/rq_dashboard/base.html), and build their rows with underscore's templates, which
need eval. Anything else (JSON, event streams, files) is no document at all: `default-src 'none'`.
"""

from __future__ import annotations

import secrets

from flask import Flask, Response, g, request

PAGE_POLICY = {
    "default-src": "'self'",
    "script-src": "'self'",
    # Swagger UI and rq-dashboard set a few style attributes; styles cannot run code.
    "style-src": "'self' 'unsafe-inline'",
    "img-src": "'self' data: blob:",  # icons inlined in the stylesheets; the page's downloads
    "media-src": "'self' blob:",  # a recording played back
    "connect-src": "'self'",
    "object-src": "'none'",
    "base-uri": "'none'",
    "form-action": "'self'",
    "frame-ancestors": "'none'",
}
"""The Content-Security-Policy of an HTML page."""

OTHER_POLICY = "default-src 'none'; frame-ancestors 'none'"
"""The Content-Security-Policy of anything that is not a page (JSON, event streams, files)."""

DASHBOARD_PREFIX = "/rq"


def csp_nonce() -> str:
    """This response's script nonce (made on first use; templates call it as `csp_nonce()`)."""
    if "csp_nonce" not in g:
        g.csp_nonce = secrets.token_urlsafe(18)
    return g.csp_nonce


def content_security_policy(response: Response) -> str:
    """The policy for `response`: the pages' one for HTML, with this response's nonce if it used one."""
    if response.mimetype != "text/html":
        return OTHER_POLICY
    policy = dict(PAGE_POLICY)
    if "csp_nonce" in g:
        policy["script-src"] += f" 'nonce-{g.csp_nonce}'"
    if request.path == DASHBOARD_PREFIX or request.path.startswith(DASHBOARD_PREFIX + "/"):
        policy["script-src"] += " 'unsafe-eval'"  # underscore's _.template compiles with new Function
    return "; ".join(f"{name} {value}" for name, value in policy.items())


def register_security_headers(app: Flask) -> None:
    """Add the security headers to every response of `app` (errors and streams included)."""
    app.jinja_env.globals["csp_nonce"] = csp_nonce

    @app.after_request
    def _secure(response: Response) -> Response:
        response.headers["X-Content-Type-Options"] = "nosniff"
        response.headers["X-Frame-Options"] = "DENY"
        response.headers["Referrer-Policy"] = "no-referrer"
        response.headers["Content-Security-Policy"] = content_security_policy(response)
        return response

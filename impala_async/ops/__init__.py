"""Operations: CurveZMQ keys and ZAP (auth), the small HTTP server behind /metrics and /healthz (httpd), ZeroMQ
connection liveness (zmtp). Imports only ``core`` of the package."""

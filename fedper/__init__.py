from fedper.web import web_root  # the web agent's page folder, which fedper-coordinator --web-port serves

__all__ = ["web_root"]

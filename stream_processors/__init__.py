"""Stream processors on faust-streaming: moderation on the ingress and token paths,
transcript writes, billing rows and batch outcomes, each a small agent over a topic. The stores they write
to live in ``tokenbus.stores``."""

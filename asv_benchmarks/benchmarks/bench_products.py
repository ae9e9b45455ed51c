"""Suite 5: per-sample gradients, NTK and GGN diagonal of problem 1's class MLP(784, 20, 10).

The targets of issue 13, each method of ``bench.bench_products.METHODS`` at the batch size
the issue names: per_sample_grads (B = 512) against vmap(grad) over functional_call and the floor
of allocating and filling (B, P); ntk (B1 = B2 = 256, full (B, B, Y, Y)) against the tutorial's
two vmap(jacrev) Jacobians contracted; ggn(diagonal=True) (B = 1,000) against per_sample_grads on
the same batch.
"""

from bench.bench_products import METHODS, SIZES, problem

from ._common import DEVICE, sync


class Products:
    params = (list(METHODS), sorted({m for methods in METHODS.values() for m in methods}))
    param_names = ["target", "method"]
    timeout = 600

    def setup(self, target: str, method: str) -> None:
        if method not in METHODS[target]:
            raise NotImplementedError(f"{method} is not a method of {target}")
        model, x, y = problem(SIZES[target])
        self.model, self.x, self.y = model.to(DEVICE), x.to(DEVICE), y.to(DEVICE)
        self.fn = METHODS[target][method]
        self.fn(self.model, self.x[:2], self.y[:2])  # lazy imports and caches out of the timings
        sync()

    def time_products(self, target: str, method: str) -> None:
        self.fn(self.model, self.x, self.y)
        sync()

    def peakmem_products(self, target: str, method: str) -> None:
        self.fn(self.model, self.x, self.y)

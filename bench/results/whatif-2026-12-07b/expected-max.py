"""The sd of a normal whose expected maximum of the field's 278,024 samples is its longest, 1,070
tokens, around its mean 666 (README.md here). Numerical integration of E[max] = int x n Phi^(n-1) phi dx."""
import math

import numpy as np

n = 278024
x = np.linspace(-2, 8, 200001)
Phi = 0.5 * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))
pdf = n * Phi ** (n - 1) * np.exp(-x * x / 2) / math.sqrt(2 * math.pi)
em = np.trapezoid(x * pdf, x)
print(f"E[max of {n} standard normals] = {em:.3f}; sd = (1070 - 666) / {em:.3f} = {(1070 - 666) / em:.1f} tokens")

#ifndef STATS_H
#define STATS_H
double mean(const double *xs, long n);
void histogram(const double *xs, long n, int bins, long *counts);
#endif

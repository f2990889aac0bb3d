/*
 * nonewprivs: the stand-in for critest's nonewprivs image: installed setuid root, it prints
 * `Effective uid: N`: 0 unless the container runs with no_new_privs (then its caller's uid).
 */
#include <stdio.h>
#include <unistd.h>

int main(void) {
    printf("Effective uid: %d\n", (int)geteuid());
    return 0;
}

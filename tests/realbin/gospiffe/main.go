// go-spiffe-jwt: the test suite's go-spiffe v2 client of the Workload API's JWT profile
// (tests/e2e/test_workload_api_jwt.py). Go only because go-spiffe is Go; no example main package
// of go-spiffe takes a socket path and an audience (they dial a fixed /tmp socket and a fixed
// server), so this one does, and nothing more:
//
//	go-spiffe-jwt SOCKET AUDIENCE
//
// fetches a JWT-SVID for AUDIENCE (workloadapi.FetchJWTSVID), the JWT bundles
// (workloadapi.FetchJWTBundles), validates the token offline against them
// (jwtsvid.ParseAndValidate) and through the Workload API (workloadapi.ValidateJWTSVID), and
// prints one JSON line of what it saw. Any failure exits 1 with the error on stderr.
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"time"

	"github.com/spiffe/go-spiffe/v2/svid/jwtsvid"
	"github.com/spiffe/go-spiffe/v2/workloadapi"
)

func main() {
	if len(os.Args) != 3 {
		fmt.Fprintln(os.Stderr, "usage: go-spiffe-jwt SOCKET AUDIENCE")
		os.Exit(2)
	}
	if err := run(os.Args[1], os.Args[2]); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}

func run(socket, audience string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	addr := workloadapi.WithAddr("unix://" + socket)
	svid, err := workloadapi.FetchJWTSVID(ctx, jwtsvid.Params{Audience: audience}, addr)
	if err != nil {
		return fmt.Errorf("FetchJWTSVID: %w", err)
	}
	bundles, err := workloadapi.FetchJWTBundles(ctx, addr)
	if err != nil {
		return fmt.Errorf("FetchJWTBundles: %w", err)
	}
	offline, err := jwtsvid.ParseAndValidate(svid.Marshal(), bundles, []string{audience})
	if err != nil {
		return fmt.Errorf("ParseAndValidate: %w", err)
	}
	validated, err := workloadapi.ValidateJWTSVID(ctx, svid.Marshal(), audience, addr)
	if err != nil {
		return fmt.Errorf("ValidateJWTSVID: %w", err)
	}
	return json.NewEncoder(os.Stdout).Encode(map[string]any{
		"spiffe_id":    svid.ID.String(),
		"audience":     svid.Audience,
		"expiry":       svid.Expiry.Unix(),
		"offline_id":   offline.ID.String(),
		"validated_id": validated.ID.String(),
		"bundles":      len(bundles.Bundles()),
		"token":        svid.Marshal(),
	})
}

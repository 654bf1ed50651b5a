package caclient

import (
	"errors"
	"fmt"
	"net/url"
	"strings"
)

// LocationFromClusterURL returns the location a Mesh CA request names (Config.Location) for a GKE
// cluster URL (GKE_CLUSTER_URL), as Istio's Mesh CA client read it: the <L> of
// https://container.googleapis.com/v1/projects/<P>/locations/<L>/clusters/<C>; none for a GKE Hub
// membership (https://gkehub.googleapis.com/...), which is global. Anything else is an error:
// Istio sent no location then, and the request would go where the operator did not mean.
func LocationFromClusterURL(clusterURL string) (string, error) {
	u, err := url.Parse(clusterURL)
	if err != nil {
		return "", fmt.Errorf("is not a URL: %w", err)
	}
	if u.Scheme == "https" && u.Host == "gkehub.googleapis.com" {
		return "", nil
	}
	segs := strings.Split(strings.Trim(u.Path, "/"), "/")
	for i := 0; i+5 < len(segs); i++ {
		if segs[i] == "projects" && segs[i+2] == "locations" && segs[i+4] == "clusters" &&
			segs[i+1] != "" && segs[i+3] != "" && segs[i+5] != "" {
			return segs[i+3], nil
		}
	}
	return "", errors.New("names no location: want https://container.googleapis.com/v1/projects/PROJECT/locations/LOCATION/clusters/CLUSTER, or a GKE Hub membership URL")
}
